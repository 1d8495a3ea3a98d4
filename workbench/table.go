package main

import (
	"fmt"
	"io"
	"math"
	"strings"
	"text/tabwriter"

	"github.com/vlkv/vlkv/gohost/expt"
)

// table is what a benchmark or a selftest returns: columns that describe
// themselves and rows keyed by column name (kernels_py/tables.py). Any table
// prints the same way, so no Go type mirrors a Python row.
type table struct {
	Columns []expt.Column    `json:"columns"`
	Rows    []map[string]any `json:"rows"`
}

// print writes the columns marked for the text table, formatted by unit.
func (t table) print(w io.Writer) error {
	var shown []expt.Column
	for _, c := range t.Columns {
		if c.Show {
			shown = append(shown, c)
		}
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	for _, c := range shown {
		label := c.Label
		if label == "" {
			label = c.Name
		}
		fmt.Fprintf(tw, "%s\t", label)
	}
	fmt.Fprintln(tw)
	for _, row := range t.Rows {
		for _, c := range shown {
			fmt.Fprintf(tw, "%s\t", formatCell(c.Unit, row[c.Name]))
		}
		fmt.Fprintln(tw)
	}
	return tw.Flush()
}

// legend says what each column the text table shows means, by the label
// it is shown under: for tables whose short labels need it.
func (t table) legend() string {
	var b strings.Builder
	for _, c := range t.Columns {
		if !c.Show {
			continue
		}
		label := c.Label
		if label == "" {
			label = c.Name
		}
		fmt.Fprintf(&b, "  %s: %s\n", label, c.Doc)
	}
	return b.String()
}

// columnDocs lists the columns and what they mean, for --help.
func columnDocs(cols []expt.Column) string {
	var b strings.Builder
	for _, c := range cols {
		unit := ""
		if c.Unit != "" {
			unit = " [" + c.Unit + "]"
		}
		shown := ""
		if c.Show && c.Label != "" && c.Label != c.Name {
			shown = fmt.Sprintf(" (%q in the table)", c.Label)
		}
		fmt.Fprintf(&b, "  %s%s%s: %s\n", c.Name, unit, shown, c.Doc)
	}
	return b.String()
}

// formatCell prints a value the way its unit reads best; a missing value
// (a size skipped, a number only a GPU measures) is "-".
func formatCell(unit string, v any) string {
	if v == nil {
		return "-"
	}
	f, isNumber := v.(float64) // JSON numbers decode as float64
	if !isNumber {
		return fmt.Sprint(v)
	}
	switch unit {
	case "ms":
		return secs(f / 1e3)
	case "s":
		return secs(f)
	case "bytes":
		return humanBytes(int64(f))
	case "x":
		return fmt.Sprintf("%.2fx", f)
	case "%":
		return fmt.Sprintf("%.1f%%", f)
	case "GB/s":
		return threeDigits(f)
	}
	if f == math.Trunc(f) && math.Abs(f) < 1e15 {
		return fmt.Sprintf("%d", int64(f))
	}
	return fmt.Sprintf("%.3g", f)
}

// threeDigits prints a rate with about three significant digits, never in
// exponent form.
func threeDigits(f float64) string {
	switch a := math.Abs(f); {
	case a >= 100:
		return fmt.Sprintf("%.0f", f)
	case a >= 10:
		return fmt.Sprintf("%.1f", f)
	}
	return fmt.Sprintf("%.2f", f)
}
