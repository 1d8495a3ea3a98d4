package expt

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
)

// Presses are the NVIDIA kvpress presses a method runs, by class name, as
// kernels_py.models.presses.schema publishes them. The kvpress method's
// jobs name one with its press param, give its constructor's own
// parameters in press_args and, for a press that wraps others, those in
// inner_press; Check refuses what presses.make would, so a misspelt press
// or parameter fails the plan rather than the job.
type Presses map[string]*Press

// Press is one press class's constructor.
type Press struct {
	Params   []string `json:"params"`   // every parameter it takes
	Required []string `json:"required"` // those without a default
	Wraps    string   `json:"wraps"`    // the parameter it takes other presses through; "" for none
	// Types are the types of the parameters whose annotation press_args
	// can give a value of (pressTypes); the others go unchecked.
	Types    map[string]string `json:"types"`
	Nullable []string          `json:"nullable"` // those of Types that also take none
}

// pressTypes name the types of Press.Types as the schema writes them, each
// as an error says it.
var pressTypes = map[string]string{
	"int": "an int", "float": "a float", "bool": "a bool (true or false)", "str": "a str",
	"ints": "a list of ints", "floats": "a list of floats", "bools": "a list of bools", "strs": "a list of strs",
}

// NoPress is the press value that runs no press (presses.NO_PRESS): the
// model's own cache, whatever press_args say.
const NoPress = "none"

// pressParams are the method params Check reads.
var pressParams = []string{"press", "press_args", "inner_press"}

// parse checks the presses are complete and the method has the params
// they are named through.
func (ps Presses) parse(params Params) error {
	if ps == nil {
		return nil
	}
	for _, p := range pressParams {
		if param, ok := params[p]; !ok || param.Type != TypeStr {
			return fmt.Errorf("the method has no str param %q to name a press through", p)
		}
	}
	for _, name := range sortedKeys(ps) {
		p := ps[name]
		if p == nil {
			return fmt.Errorf("%s: empty", name)
		}
		for _, r := range p.Required {
			if !slices.Contains(p.Params, r) {
				return fmt.Errorf("%s: required %q is not one of its params", name, r)
			}
		}
		if p.Wraps != "" && !slices.Contains(p.Params, p.Wraps) {
			return fmt.Errorf("%s: wraps through %q, not one of its params", name, p.Wraps)
		}
		for _, param := range sortedKeys(p.Types) {
			if !slices.Contains(p.Params, param) {
				return fmt.Errorf("%s: type of %q, not one of its params", name, param)
			}
			if _, ok := pressTypes[p.Types[param]]; !ok {
				return fmt.Errorf("%s: %q has type %q; want one of %s", name, param, p.Types[param], strings.Join(sortedKeys(pressTypes), ", "))
			}
		}
		for _, n := range p.Nullable {
			if _, ok := p.Types[n]; !ok {
				return fmt.Errorf("%s: nullable %q has no type", name, n)
			}
		}
	}
	if msg := ps.Check(params.Defaults()); msg != "" {
		return fmt.Errorf("the defaults break it: %s", msg)
	}
	return nil
}

// Violated returns the message of the first rule params break, else what
// is wrong with the press they name, else "". params must hold every
// parameter (defaults filled in).
func (m *Method) Violated(params map[string]any) (string, error) {
	if msg, err := m.Rules.Violated(params); err != nil || msg != "" {
		return msg, err
	}
	return m.Presses.Check(params), nil
}

// Check returns what is wrong with the press a job's params name, or "".
func (ps Presses) Check(params map[string]any) string {
	if ps == nil {
		return ""
	}
	name, _ := params["press"].(string)
	args, _ := params["press_args"].(string)
	inner, _ := params["inner_press"].(string)
	// The job reads press_args whatever the press, so their form counts
	// even where no press takes them.
	parsed, err := parsePressArgs(args)
	if err != nil {
		return err.Error()
	}
	if name == NoPress {
		return ""
	}
	return ps.check(name, parsed, inner, append(sortedKeys(ps), NoPress))
}

// check follows presses.make: a known press, parameters it takes, none
// that a knob sets, values of their types, inner presses where it wraps
// some, and every parameter without a default set. known are the names an
// unknown name is told of.
func (ps Presses) check(name string, args []pressArg, inner string, known []string) string {
	p, ok := ps[name]
	if !ok {
		return "press " + UnknownName(name, known)
	}
	var given []string
	for _, a := range args {
		if !slices.Contains(p.Params, a.name) {
			if slices.Contains(pressParams, a.name) {
				return fmt.Sprintf("press_args: %s takes no parameter %q: %s is a knob of the method, set it there (%s = %q)", name, a.name, a.name, a.name, a.value)
			}
			takes := strings.Join(p.Params, ", ")
			if takes == "" {
				takes = "nothing"
			}
			return fmt.Sprintf("press_args: %s takes no parameter %q%s; it takes: %s", name, a.name, Closest(a.name, p.Params), takes)
		}
		given = append(given, a.name)
	}
	for _, a := range args {
		if msg := p.collides(name, a); msg != "" {
			return msg
		}
	}
	for _, a := range args {
		if msg := p.checkType(name, a); msg != "" {
			return msg
		}
	}
	switch {
	case p.Wraps != "" && inner != "":
		for _, n := range strings.Split(inner, ",") {
			if n = strings.TrimSpace(n); n == "" {
				continue
			}
			if msg := ps.check(n, nil, "", sortedKeys(ps)); msg != "" {
				return "inner_press: " + msg
			}
		}
		given = append(given, p.Wraps)
	case p.Wraps != "" && slices.Contains(p.Required, p.Wraps):
		several := ""
		if p.Wraps == "presses" {
			several = "; several, comma-separated"
		}
		return fmt.Sprintf("%s wraps another press: name it with inner_press (e.g. inner_press = \"SnapKVPress\"%s)", name, several)
	case inner != "" && p.Wraps == "":
		return fmt.Sprintf("%s wraps no press: inner_press = %q does not apply", name, inner)
	}
	if slices.Contains(p.Params, "compression_ratio") {
		given = append(given, "compression_ratio") // the method's own knob
	}
	var missing []string
	for _, r := range p.Required {
		if !slices.Contains(given, r) {
			missing = append(missing, r)
		}
	}
	if len(missing) > 0 {
		return fmt.Sprintf("%s needs %s: set them in press_args (a list: items separated by semicolons)", name, strings.Join(missing, ", "))
	}
	return ""
}

// collides says why press_args may not set a: the method's knobs set it,
// and press_args would silently replace what they say (presses.make
// refuses the same).
func (p *Press) collides(name string, a pressArg) string {
	switch {
	case a.name == "compression_ratio":
		// make gives the knob's value only where press_args have none, and
		// the results record the knob's.
		return fmt.Sprintf("press_args: set compression_ratio with the method's compression_ratio knob (compression_ratio = %s), not in press_args", a.value)
	case a.name == p.Wraps:
		// make puts inner_press's presses there; press_args can only give a
		// string, never a press.
		if a.name == "presses" {
			return fmt.Sprintf("press_args: %s's presses are the presses it wraps: name them with inner_press (e.g. inner_press = \"SnapKVPress, KnormPress\"), not in press_args", name)
		}
		return fmt.Sprintf("press_args: %s's %s is the press it wraps: name it with inner_press (e.g. inner_press = \"SnapKVPress\"), not in press_args", name, a.name)
	}
	return ""
}

// checkType says why a's value is not of its parameter's type, as
// presses.parse_args reads it; "" where it is or the type is unknown.
func (p *Press) checkType(name string, a pressArg) string {
	typ, ok := p.Types[a.name]
	if !ok {
		return ""
	}
	nullable := slices.Contains(p.Nullable, a.name)
	elem, list := strings.CutSuffix(typ, "s")
	kind := pyValueKind(a.value)
	switch {
	case nullable && kind == "none":
		return ""
	case list && strings.Contains(a.value, ";"):
		if !slices.ContainsFunc(strings.Split(a.value, ";"), func(item string) bool { return !fitsType(elem, pyValueKind(item)) }) {
			return ""
		}
	case !list && !strings.Contains(a.value, ";") && fitsType(typ, kind):
		return ""
	}
	want := pressTypes[typ]
	if list {
		want += " (items separated by semicolons, e.g. 0.5;0.25)"
	}
	if nullable {
		want += " or none"
	}
	why := ""
	if typ == "str" && !strings.Contains(a.value, ";") {
		// The one case where the value looks right: say what it is read as.
		why = fmt.Sprintf(" (press_args reads it as %s)", strings.TrimSuffix(pressTypes[kind], " (true or false)"))
		if kind == "none" {
			why = " (press_args reads it as none)"
		}
	}
	return fmt.Sprintf("press_args: %s's %s takes %s, not %q%s", name, a.name, want, a.value, why)
}

// fitsType reports whether a value presses.parse_args reads as kind suits
// a parameter of type typ (an int where a float is wanted included, as
// Python takes it).
func fitsType(typ, kind string) bool {
	return kind == typ || typ == "float" && kind == "int"
}

// pyDigits are the digits of a Python number: any decimal digit, single
// underscores between them (PEP 515).
const pyDigits = `\p{Nd}+(?:_\p{Nd}+)*`

// Python's int() and float() literals, the values presses._value reads as
// numbers.
var (
	pyInt   = regexp.MustCompile(`^[+-]?` + pyDigits + `$`)
	pyFloat = regexp.MustCompile(`^[+-]?(?:(?:` + pyDigits + `(?:\.(?:` + pyDigits + `)?)?|\.` + pyDigits + `)(?:[eE][+-]?` + pyDigits + `)?|(?i:inf|infinity|nan))$`)
)

// pyValueKind is the type presses._value reads a value as: "bool", "none",
// "int", "float" or "str".
func pyValueKind(raw string) string {
	raw = strings.TrimSpace(raw)
	switch lower := strings.ToLower(raw); {
	case lower == "true" || lower == "false":
		return "bool"
	case lower == "none":
		return "none"
	case pyInt.MatchString(raw):
		return "int"
	case pyFloat.MatchString(raw):
		return "float"
	}
	return "str"
}

// pressArg is one name=value pair of press_args.
type pressArg struct{ name, value string }

// parsePressArgs reads press_args as presses.parse_args does: name=value
// pairs separated by commas, each name once (a second would silently win).
func parsePressArgs(args string) ([]pressArg, error) {
	var out []pressArg
	for _, part := range strings.Split(args, ",") {
		if part = strings.TrimSpace(part); part == "" {
			continue
		}
		key, value, eq := strings.Cut(part, "=")
		if key = strings.TrimSpace(key); !eq || key == "" {
			return nil, fmt.Errorf("press_args %q: want name=value pairs separated by commas, e.g. window_size=32 "+
				"(a list: items separated by semicolons, e.g. compression_ratios=0.5;0.25)", args)
		}
		if slices.ContainsFunc(out, func(a pressArg) bool { return a.name == key }) {
			return nil, fmt.Errorf("press_args %q sets %s twice: keep one", args, key)
		}
		out = append(out, pressArg{key, strings.TrimSpace(value)})
	}
	return out, nil
}
