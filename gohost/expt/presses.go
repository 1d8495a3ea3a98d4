package expt

import (
	"fmt"
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
	}
	if msg := ps.Check(params.defaults()); msg != "" {
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
	if name == NoPress {
		return ""
	}
	keys, err := pressArgNames(args)
	if err != nil {
		return err.Error()
	}
	return ps.check(name, keys, inner, append(sortedKeys(ps), NoPress))
}

// check follows presses.make: a known press, parameters it takes, inner
// presses where it wraps some, and every parameter without a default set.
// known are the names an unknown name is told of.
func (ps Presses) check(name string, args []string, inner string, known []string) string {
	p, ok := ps[name]
	if !ok {
		return "press " + UnknownName(name, known)
	}
	for _, a := range args {
		if !slices.Contains(p.Params, a) {
			takes := strings.Join(p.Params, ", ")
			if takes == "" {
				takes = "nothing"
			}
			return fmt.Sprintf("press_args: %s takes no parameter %q%s; it takes: %s", name, a, Closest(a, p.Params), takes)
		}
	}
	given := slices.Clone(args)
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

// pressArgNames are the names press_args sets, read as presses.parse_args
// reads them: name=value pairs separated by commas.
func pressArgNames(args string) ([]string, error) {
	var names []string
	for _, part := range strings.Split(args, ",") {
		if part = strings.TrimSpace(part); part == "" {
			continue
		}
		key, _, eq := strings.Cut(part, "=")
		if key = strings.TrimSpace(key); !eq || key == "" {
			return nil, fmt.Errorf("press_args %q: want name=value pairs separated by commas, e.g. window_size=32 "+
				"(a list: items separated by semicolons, e.g. compression_ratios=0.5;0.25)", args)
		}
		names = append(names, key)
	}
	return names, nil
}
