package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/rs/zerolog"
	"github.com/spf13/cobra"

	"github.com/vlkv/vlkv/gohost/expt"
	"github.com/vlkv/vlkv/gohost/pyrt"
	"github.com/vlkv/vlkv/gohost/worker"
)

// schemaFile is where the Python side publishes its methods, workloads and
// benchmarks with their knobs (kernels_py/schema.py writes it).
var schemaFile = filepath.Join("kernels_py", "schema.json")

const regenerateHint = "after adding or changing a method, workload or benchmark, regenerate it with `workbench schema`"

// schema reads the schema of the kernels root this command uses.
func (a *app) schema() (*expt.Schema, pyrt.KernelsRoot, error) {
	kernels, err := a.kernelsRoot()
	if err != nil {
		return nil, kernels, err
	}
	s, err := loadSchema(kernels)
	return s, kernels, err
}

func loadSchema(kernels pyrt.KernelsRoot) (*expt.Schema, error) {
	s, err := expt.LoadSchema(filepath.Join(kernels.Dir, schemaFile))
	if err != nil {
		return nil, fmt.Errorf("%w (%s)", err, regenerateHint)
	}
	return s, nil
}

// unknownNameRE finds the name an "is unknown" error of a script is about.
var unknownNameRE = regexp.MustCompile(`("(?:[^"\\]|\\.)*") is unknown`)

// staleSchemaHint says how to fix an unknown name in a script (the error's
// msg) when the kernels_py sources name it but schema.json does not: a
// method, workload or knob added in Python after the schema was last
// regenerated; else "". It compares contents (modification times say
// nothing after a checkout); reading the sources is cheap enough on an
// error path.
func staleSchemaHint(kernels pyrt.KernelsRoot, msg string) string {
	m := unknownNameRE.FindStringSubmatch(msg)
	if m == nil {
		return ""
	}
	name, err := strconv.Unquote(m[1])
	if err != nil {
		return ""
	}
	schema, err := os.ReadFile(filepath.Join(kernels.Dir, schemaFile))
	if err != nil || bytes.Contains(schema, []byte(strconv.Quote(name))) {
		return ""
	}
	if !sourcesName(filepath.Join(kernels.Dir, "kernels_py"), name) {
		return ""
	}
	return fmt.Sprintf(" (kernels_py names %q but kernels_py/schema.json does not: if you added or changed a method, "+
		"workload, benchmark, op or knob, run `workbench schema`)", name)
}

// unknownHint says how to fix a name a command was given that schema.json
// does not hold (what staleSchemaHint says), and for an op, a folder
// kernels_py/ops/NAME/ that OPS has no line for; else "".
func unknownHint(kernels pyrt.KernelsRoot, kind, name string) string {
	if kind == "op" {
		pkg := filepath.Join(kernels.Dir, "kernels_py", "ops")
		registry, err := os.ReadFile(filepath.Join(pkg, "__init__.py"))
		if _, serr := os.Stat(filepath.Join(pkg, name, "__init__.py")); serr == nil && err == nil &&
			!bytes.Contains(registry, []byte("Op("+strconv.Quote(name))) {
			return fmt.Sprintf(" (kernels_py/ops/%s/ has no line in OPS (kernels_py/ops/__init__.py): add "+
				"Op(%q, benchmark=\"<its benchmark>\"), then run `workbench schema`)", name, name)
		}
	}
	return staleSchemaHint(kernels, strconv.Quote(name)+" is unknown")
}

// sourcesName says whether a Python source under dir (tests left out)
// holds name as a string literal (a method's or workload's registered
// name) or declares it as a field (a knob: `name: float = knob(...)`).
func sourcesName(dir, name string) bool {
	literals := [][]byte{[]byte(`"` + name + `"`), []byte(`'` + name + `'`)}
	field := regexp.MustCompile(`(?m)^[ \t]+` + regexp.QuoteMeta(name) + `[ \t]*:`)
	found := false
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		switch {
		case err != nil:
			return nil
		case d.IsDir() && (d.Name() == "tests" || d.Name() == "__pycache__"):
			return filepath.SkipDir
		case d.IsDir() || !strings.HasSuffix(p, ".py"):
			return nil
		}
		src, err := os.ReadFile(p)
		if err == nil && (bytes.Contains(src, literals[0]) || bytes.Contains(src, literals[1]) || field.Match(src)) {
			found = true
			return filepath.SkipAll
		}
		return nil
	})
	return found
}

// benchmarkList is the schema `workbench bench` builds its subcommands from,
// or why it could not be read.
type benchmarkList struct {
	schema  *expt.Schema
	kernels pyrt.KernelsRoot
	err     error
}

// benchmarksFor reads the schema of the kernels root the command line will
// use. Commands exist before flags are parsed, so --kernels is looked up in
// the raw arguments here; a command that runs resolves the root again, the
// usual way.
func benchmarksFor(args []string) benchmarkList {
	a := &app{}
	for i, arg := range args {
		if arg == "--" {
			break
		}
		if v, ok := strings.CutPrefix(arg, "--kernels="); ok {
			a.flags.kernels = v
		} else if arg == "--kernels" && i+1 < len(args) {
			a.flags.kernels = args[i+1]
		}
	}
	kernels, err := a.kernelsRoot()
	if err != nil {
		return benchmarkList{err: err}
	}
	s, err := loadSchema(kernels)
	return benchmarkList{schema: s, kernels: kernels, err: err}
}

func newSchemaCmd(a *app) *cobra.Command {
	var check bool
	cmd := &cobra.Command{
		Use:   "schema",
		Short: "Regenerate kernels_py/schema.json (the methods', workloads' and benchmarks' knobs) from the Python code",
		Long: `schema asks a worker for the knobs of every registered method, workload and
benchmark (with their types, defaults, bounds, docs and paper references) and
writes them to kernels_py/schema.json, which plan, run, methods and bench read
without starting Python. Run it after adding or changing a knob. --check only
says whether the file is up to date (exit 1 when it is not).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.withWorker(cmd.Context(), func(s *session, w *worker.Worker) error {
				raw, err := w.Run(cmd.Context(), worker.Job{Fn: "kernels_py.schema:text"})
				if err != nil {
					return a.jobFailed("schema", err)
				}
				var text string
				if err := json.Unmarshal(raw, &text); err != nil {
					return fmt.Errorf("schema: unexpected result: %w", err)
				}
				if _, err := expt.ParseSchema([]byte(text)); err != nil {
					return fmt.Errorf("the Python side produced a schema Go cannot read: %w", err)
				}
				path := filepath.Join(s.kernels.Dir, schemaFile)
				old, err := os.ReadFile(path)
				if err != nil && !errors.Is(err, os.ErrNotExist) {
					return err
				}
				switch {
				case bytes.Equal(old, []byte(text)):
					fmt.Fprintf(a.stdout, "%s is up to date\n", path)
					return nil
				case check:
					return fmt.Errorf("%s is out of date: run `workbench schema`", path)
				case s.kernels.Source == "embedded":
					return fmt.Errorf("the kernels root is the copy embedded in this binary, which is not edited: run in a checkout or pass --kernels DIR")
				}
				if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "wrote %s\n", path)
				return nil
			})
		},
	}
	cmd.Flags().BoolVar(&check, "check", false, "only check that the file is up to date")
	return cmd
}

func newMethodsCmd(a *app) *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "methods [NAME...]",
		Short: "List the compression methods and workloads with their knobs, defaults, bounds and docs",
		Long: `methods lists every registered compression method (or the ones named) with
its knobs: type, bounds, default, what it does and where the paper defines
it, and the knobs each comparison protocol sets on it; then the protocols
(experiment(protocol=...)) and the workloads experiments run on, with
their knobs. It reads kernels_py/schema.json and starts no Python.`,
		RunE: func(cmd *cobra.Command, args []string) error {
			s, kernels, err := a.schema()
			if err != nil {
				return err
			}
			names := s.MethodNames()
			if len(args) > 0 {
				for _, n := range args {
					if _, ok := s.Methods[n]; ok {
						continue
					}
					if _, ok := s.Workloads[n]; ok {
						return &usageError{fmt.Errorf("%q is a workload, not a method: `workbench methods` lists the workloads after the methods", n)}
					}
					return &usageError{fmt.Errorf("method %s%s", s.UnknownMethod(n), unknownHint(kernels, "method", n))}
				}
				names = distinct(args)
			}
			if asJSON {
				return writeSchemaJSON(a.stdout, s, names, len(args) == 0)
			}
			for _, n := range names {
				m := s.Methods[n]
				fmt.Fprintf(a.stdout, "%s: %s\n", m.Name, m.Doc)
				if m.Paper != "" {
					fmt.Fprintf(a.stdout, "  paper: %s\n", m.Paper)
				}
				printParams(a.stdout, m.Params)
				printRules(a.stdout, m.Rules)
				printProtocols(a.stdout, m, s.ProtocolNames())
				for _, note := range m.Notes {
					fmt.Fprintf(a.stdout, "  %s\n", note)
				}
				fmt.Fprintln(a.stdout)
			}
			if len(args) == 0 {
				for _, n := range s.ProtocolNames() {
					fmt.Fprintf(a.stdout, "protocol %q: %s\n", n, s.Protocols[n])
				}
				if len(s.Protocols) > 0 {
					fmt.Fprintln(a.stdout)
				}
				for _, n := range s.WorkloadNames() {
					w := s.Workloads[n]
					def := ""
					if n == s.DefaultWorkload {
						def = " (the default)"
					}
					fmt.Fprintf(a.stdout, "workload %q%s: %s\n", n, def, w.Doc)
					printParams(a.stdout, w.Params)
					printRules(a.stdout, w.Rules)
				}
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print methods and workloads as JSON")
	return cmd
}

func printParams(w io.Writer, ps expt.Params) {
	if len(ps) == 0 {
		fmt.Fprintln(w, "  (no knobs)")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, name := range ps.Names() {
		fmt.Fprintf(tw, "  %s\t%s\n", name, ps[name].Describe())
	}
	tw.Flush()
}

// printProtocols lists what each protocol sets on m ("sets nothing" for
// the ones that leave it at its defaults).
func printProtocols(w io.Writer, m *expt.Method, protocols []string) {
	for _, p := range protocols {
		set := m.Protocols[p]
		if len(set) == 0 {
			fmt.Fprintf(w, "  protocol %s: sets nothing\n", p)
			continue
		}
		parts := make([]string, 0, len(set))
		for _, k := range slices.Sorted(maps.Keys(set)) {
			parts = append(parts, fmt.Sprintf("%s=%v", k, set[k]))
		}
		fmt.Fprintf(w, "  protocol %s: sets %s\n", p, strings.Join(parts, ", "))
	}
}

// printRules lists the constraints between knobs that plan checks.
func printRules(w io.Writer, rules expt.Rules) {
	if len(rules) == 0 {
		return
	}
	fmt.Fprintln(w, "  rules (plan rejects a job that breaks one):")
	for _, r := range rules {
		fmt.Fprintf(w, "    %s\n", r.Check)
	}
}

// paramJSON is one knob in `workbench methods --json`.
type paramJSON struct {
	Name    string   `json:"name"`
	Type    string   `json:"type"`
	Default any      `json:"default"`
	Min     *float64 `json:"min,omitempty"`
	Max     *float64 `json:"max,omitempty"`
	Choices []any    `json:"choices,omitempty"`
	Doc     string   `json:"doc"`
	Ref     string   `json:"ref,omitempty"`
	// Required: a script must set it (its default "" only holds the place),
	// as the text listing says instead of the default.
	Required bool `json:"required,omitempty"`
	// Paths: a file or folder, relative ones from the kernels root.
	Paths bool `json:"paths,omitempty"`
}

func paramsJSON(ps expt.Params) []paramJSON {
	out := []paramJSON{}
	for _, name := range ps.Names() {
		p := ps[name]
		out = append(out, paramJSON{name, string(p.Type), p.Default, p.Min, p.Max, p.Choices, p.Doc, p.Ref, p.Required, p.Paths})
	}
	return out
}

func writeSchemaJSON(w io.Writer, s *expt.Schema, methods []string, withWorkloads bool) error {
	type entry struct {
		Name   string      `json:"name"`
		Doc    string      `json:"doc"`
		Paper  string      `json:"paper,omitempty"`
		Params []paramJSON `json:"params"`
		Rules  expt.Rules  `json:"rules,omitempty"`
		Notes  []string    `json:"notes,omitempty"`
		// Protocols: per protocol, the knobs it sets on the method.
		Protocols map[string]map[string]any `json:"protocols,omitempty"`
	}
	out := struct {
		Methods         []entry           `json:"methods"`
		Protocols       map[string]string `json:"protocols,omitempty"`
		Workloads       []entry           `json:"workloads,omitempty"`
		DefaultWorkload string            `json:"default_workload,omitempty"`
	}{Methods: []entry{}}
	for _, n := range methods {
		m := s.Methods[n]
		out.Methods = append(out.Methods, entry{m.Name, m.Doc, m.Paper, paramsJSON(m.Params), m.Rules, m.Notes, m.Protocols})
	}
	if withWorkloads {
		out.Protocols = s.Protocols
		for _, n := range s.WorkloadNames() {
			out.Workloads = append(out.Workloads, entry{Name: n, Doc: s.Workloads[n].Doc, Params: paramsJSON(s.Workloads[n].Params), Rules: s.Workloads[n].Rules})
		}
		out.DefaultWorkload = s.DefaultWorkload
	}
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false) // rules compare with < and >
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

// badKnobs is the Python exception (kernels_py.params.BadKnobs) for values
// of knobs that cannot work together: the caller's mistake, not a bug.
const badKnobs = "kernels_py.params.BadKnobs"

// jobFailed wraps a worker job's failure: at the kernels_py line it comes
// from where there is one (an edited kernel that does not interpret, say),
// its traceback through Triton's internals then logged with -v only; else
// with the traceback. BadKnobs is a usage error and needs neither.
func (a *app) jobFailed(what string, err error) error {
	var je *worker.JobError
	if errors.As(err, &je) && je.Type == badKnobs { // its message names what it is about
		return &usageError{errors.New(je.Message)}
	}
	if errors.As(err, &je) && je.At != nil && je.At.File != "" {
		a.log.Debug().Msg(je.Traceback)
		raised := ""
		_, core, _ := strings.Cut(je.At.Message, ": ")
		if !strings.Contains(je.Message, core) { // raised as another error, whose words say more
			raised = fmt.Sprintf("\n(raised as %s)", je)
		}
		hint := "\n(the traceback: add -v)"
		if a.log.GetLevel() <= zerolog.DebugLevel { // logged just above
			hint = ""
		}
		return fmt.Errorf("%s%s%s", je.At.Describe(what+" failed"), raised, hint)
	}
	if errors.As(err, &je) && je.Traceback != "" {
		return fmt.Errorf("%s failed: %w\n%s", what, err, je.Traceback)
	}
	return fmt.Errorf("%s failed: %w", what, err)
}
