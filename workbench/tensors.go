package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/tensor"
)

// readSafetensorsHeader parses the header of a .safetensors file (the data is not read).
func readSafetensorsHeader(path string) (*tensor.SafetensorsHeader, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.IsDir() {
		return nil, fmt.Errorf("%s is a directory: give a .safetensors file (a trace, say)", path)
	}
	h, err := tensor.ParseSafetensorsHeader(f, st.Size())
	if err != nil {
		// A run's tensors/<job>/<name>.npy look like a header of absurd length.
		magic := make([]byte, 6)
		if _, rerr := f.ReadAt(magic, 0); rerr == nil && string(magic) == "\x93NUMPY" {
			return nil, fmt.Errorf("%s is a NumPy .npy file, not a .safetensors file: read it with numpy.load", path)
		}
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return h, nil
}

func newTensorsCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "tensors",
		Short: "Inspect .safetensors files and export their tensors as .npy for notebooks",
	}
	cmd.AddCommand(newTensorsInspectCmd(a), newTensorsToNPYCmd(a))
	return cmd
}

func newTensorsInspectCmd(a *app) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "inspect FILE.safetensors",
		Short: "Check a .safetensors header and list its tensors",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			h, err := readSafetensorsHeader(args[0])
			if err != nil {
				return err
			}
			if asJSON {
				type entry struct {
					Name  string  `json:"name"`
					DType string  `json:"dtype"`
					Shape []int64 `json:"shape"`
					Bytes int64   `json:"bytes"`
				}
				out := struct {
					Tensors  []entry           `json:"tensors"`
					Metadata map[string]string `json:"metadata"`
				}{Tensors: []entry{}, Metadata: h.Metadata}
				if out.Metadata == nil { // an object either way, as tensors is a list
					out.Metadata = map[string]string{}
				}
				for _, e := range h.Entries {
					out.Tensors = append(out.Tensors, entry{e.Name, e.DType.String(), e.Shape, e.End - e.Begin})
				}
				enc := json.NewEncoder(a.stdout)
				enc.SetIndent("", "  ")
				return enc.Encode(out)
			}
			tw := tabwriter.NewWriter(a.stdout, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "name\tdtype\tshape\tbytes")
			total := int64(0)
			for _, e := range h.Entries {
				fmt.Fprintf(tw, "%s\t%s\t%v\t%d\n", e.Name, e.DType, e.Shape, e.End-e.Begin)
				total += e.End - e.Begin
			}
			tw.Flush()
			keys := make([]string, 0, len(h.Metadata))
			for k := range h.Metadata {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				fmt.Fprintf(a.stdout, "metadata %s = %s\n", k, h.Metadata[k])
			}
			fmt.Fprintf(a.stdout, "%d tensors, %s of data\n", len(h.Entries), humanBytes(total))
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newTensorsToNPYCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "to-npy FILE.safetensors OUTDIR",
		Short: "Load a .safetensors file into an arena and write each tensor as OUTDIR/<name>.npy",
		Long: `to-npy reads every tensor of a .safetensors file into a shared-memory arena
and writes it as OUTDIR/<name>.npy (numpy has no bfloat16: those are widened
to float32). Bytes of a tensor name other than letters, digits, '_', '-' and
a '.' that does not lead are written %XX (URL escaping: "vision/proj.weight"
becomes vision%2Fproj.weight.npy), so distinct names never share a file; a
name too long for a file name is cut and ends in "~" and a hash of it.
OUTDIR/tensors.json maps every tensor name to its file; the file's
metadata (a trace's spans, tokens and model shape, as JSON text under
"vlkv"), where it has any, goes to OUTDIR/metadata.json as the same
strings tensors inspect --json gives. Existing files are replaced whole,
never half-written. An earlier export into OUTDIR is cleared first (its
tensors.json, metadata.json and the .npy files its index names), and
tensors.json is written last: a directory holding one holds the whole
export, and no other file's metadata.`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			// The header first: a directory or a .npy file is refused saying so.
			if _, err := readSafetensorsHeader(args[0]); err != nil {
				return err
			}
			st, err := os.Stat(args[0])
			if err != nil {
				return err
			}
			ar, err := tensor.NewArena(1, "to-npy", 2*st.Size()+(1<<20)) // room for the 64-byte rounding of many small tensors
			if err != nil {
				return err
			}
			defer ar.Close()
			tensors, h, err := tensor.LoadSafetensors(args[0], ar)
			if err != nil {
				return err
			}
			if err := os.MkdirAll(args[1], 0o755); err != nil {
				return err
			}
			files := map[string]string{}
			for _, e := range h.Entries {
				files[e.Name] = tensor.NPYName(e.Name) // distinct for distinct names
			}
			if err := removePreviousExport(args[1], files); err != nil {
				return err
			}
			for _, e := range h.Entries {
				path := filepath.Join(args[1], files[e.Name])
				if err := tensor.WriteNPYWidened(path, tensors[e.Name]); err != nil {
					return fmt.Errorf("%s: %w", e.Name, err)
				}
				a.log.Debug().Str("tensor", e.Name).Str("path", path).Msg("wrote")
			}
			meta := ""
			if len(h.Metadata) > 0 {
				data, _ := json.MarshalIndent(h.Metadata, "", "  ")
				meta = filepath.Join(args[1], "metadata.json")
				if err := os.WriteFile(meta, append(data, '\n'), 0o644); err != nil {
					return err
				}
				meta = ", its metadata: " + meta
			}
			// The index last: a directory with one holds the whole export.
			index, _ := json.MarshalIndent(files, "", "  ")
			if err := os.WriteFile(filepath.Join(args[1], "tensors.json"), append(index, '\n'), 0o644); err != nil {
				return err
			}
			fmt.Fprintf(a.stdout, "wrote %d tensors to %s (names to files: %s%s)\n", len(h.Entries), args[1],
				filepath.Join(args[1], "tensors.json"), meta)
			return nil
		},
	}
}

// removePreviousExport removes what an earlier to-npy left in dir and this
// export does not replace: its tensors.json, its metadata.json and the .npy
// files its index names that this one does not write. Left there, another
// file's metadata would pass for this one's, and an export that fails half
// way would have a whole-looking index of old and new files.
func removePreviousExport(dir string, files map[string]string) error {
	index := filepath.Join(dir, "tensors.json")
	data, err := os.ReadFile(index)
	if errors.Is(err, fs.ErrNotExist) {
		data = nil
	} else if err != nil {
		return fmt.Errorf("read the previous export's index: %w", err)
	}
	var previous map[string]string
	if json.Unmarshal(data, &previous) != nil {
		previous = nil // not an index to-npy wrote: no files of its to remove
	}
	keep := make(map[string]bool, len(files))
	for _, f := range files {
		keep[f] = true
	}
	stale := []string{index, filepath.Join(dir, "metadata.json")}
	for _, f := range previous {
		// Only files to-npy names: an index edited to name ../x or x.csv removes nothing else.
		if !keep[f] && f == filepath.Base(f) && strings.HasSuffix(f, ".npy") {
			stale = append(stale, filepath.Join(dir, f))
		}
	}
	for _, path := range stale {
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("remove the previous export's %s: %w", path, err)
		}
	}
	return nil
}
