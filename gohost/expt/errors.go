package expt

import (
	"bytes"
	"errors"
	"fmt"
	"regexp"
	"strings"

	"go.starlark.net/resolve"
	"go.starlark.net/starlark"
	"go.starlark.net/syntax"
)

// ScriptError is a problem in an experiment script: a syntax error, a
// runtime error, or a value the schema rejects. Pos is "file:line:col" of
// the offending call or value, so editors and terminals can jump to it.
type ScriptError struct {
	Pos string
	Msg string
	// Prints is what the script's print() calls wrote before it failed,
	// as Plan.Prints: a script is debugged by printing where it goes wrong.
	Prints []string

	err error // underlying cause, e.g. context.Canceled; see Unwrap
}

func (e *ScriptError) Error() string { return e.Pos + ": " + e.Msg }

// Unwrap lets errors.Is see through to a cancelled context.
func (e *ScriptError) Unwrap() error { return e.err }

// lineCol keys a call expression by the position of its "(": that is the
// position the Starlark compiler records for a call, and so what
// Thread.CallFrame reports for the caller of a built-in.
type lineCol struct{ line, col int32 }

// positions maps the runtime positions Starlark gives us back to syntax
// nodes, so an error can point at the keyword argument or the literal
// element at fault rather than only at the call.
type positions struct {
	file  string
	calls map[lineCol]*syntax.CallExpr
}

func indexCalls(f *syntax.File) *positions {
	p := &positions{file: f.Path, calls: make(map[lineCol]*syntax.CallExpr)}
	syntax.Walk(f, func(n syntax.Node) bool {
		if c, ok := n.(*syntax.CallExpr); ok {
			p.calls[lineCol{c.Lparen.Line, c.Lparen.Col}] = c
		}
		return true
	})
	return p
}

// path names a value inside a call's arguments: a string step is a keyword
// argument or a dict key, an int step is a list or tuple index.
type path []any

// locate returns the position of the deepest node along path that is
// spelled out literally in the call at callPos. When a value was built by
// code (a variable, a comprehension), it stops at the nearest enclosing
// literal: at worst the keyword argument, else the call itself.
func (p *positions) locate(callPos syntax.Position, at path) syntax.Position {
	call, ok := p.calls[lineCol{callPos.Line, callPos.Col}]
	if !ok {
		return callPos
	}
	var node syntax.Node = call
	var expr syntax.Expr = call
	for _, step := range at {
		n, e := descend(expr, step)
		if n == nil {
			break
		}
		node, expr = n, e
	}
	return syntax.Start(node)
}

// descend takes one step into a literal expression. It returns the node to
// report and the expression holding the value for the next step.
func descend(e syntax.Expr, step any) (syntax.Node, syntax.Expr) {
	for {
		p, ok := e.(*syntax.ParenExpr)
		if !ok {
			break
		}
		e = p.X
	}
	switch step := step.(type) {
	case string:
		switch e := e.(type) {
		case *syntax.CallExpr: // keyword argument, also of dict(...) and grid(...)
			for _, a := range e.Args {
				if b, ok := a.(*syntax.BinaryExpr); ok && b.Op == syntax.EQ {
					if id, ok := b.X.(*syntax.Ident); ok && id.Name == step {
						return b, b.Y
					}
				}
			}
		case *syntax.DictExpr:
			for _, x := range e.List {
				entry := x.(*syntax.DictEntry)
				if lit, ok := entry.Key.(*syntax.Literal); ok && lit.Value == step {
					return entry, entry.Value
				}
			}
		}
	case int:
		var elems []syntax.Expr
		switch e := e.(type) {
		case *syntax.CallExpr: // positional argument, e.g. of product(...)
			for _, a := range e.Args {
				if b, ok := a.(*syntax.BinaryExpr); ok && b.Op == syntax.EQ {
					break // keyword arguments follow the positional ones
				}
				if u, ok := a.(*syntax.UnaryExpr); ok && (u.Op == syntax.STAR || u.Op == syntax.STARSTAR) {
					break // *args: indexes no longer match
				}
				elems = append(elems, a)
			}
		case *syntax.ListExpr:
			elems = e.List
		case *syntax.TupleExpr:
			elems = e.List
		}
		if step >= 0 && step < len(elems) {
			return elems[step], elems[step]
		}
	}
	return nil, nil
}

// callPos is the position, in the script, of the call to the running
// built-in. It is normally the caller's frame; should a built-in be called
// from another built-in (sorted(key=workload)), the nearest script frame.
func (p *positions) callPos(thread *starlark.Thread) syntax.Position {
	for d := 1; d < thread.CallStackDepth(); d++ {
		if pos := thread.CallFrame(d).Pos; pos.Filename() == p.file && pos.Line > 0 {
			return pos
		}
	}
	return thread.CallFrame(1).Pos
}

// errorf builds the error a built-in returns about its own call, placed
// at the value named by at when the script spells it out.
func (p *positions) errorf(thread *starlark.Thread, at path, format string, args ...any) *ScriptError {
	pos := p.locate(p.callPos(thread), at)
	return &ScriptError{Pos: pos.String(), Msg: fmt.Sprintf(format, args...)}
}

// asScriptError turns what parsing, resolving or running a script returned
// into a *ScriptError positioned in the script. calls may be nil (before
// the file is parsed).
func asScriptError(err error, filename string, calls *positions) *ScriptError {
	var se *ScriptError
	if errors.As(err, &se) {
		return se // raised by one of our built-ins, already positioned
	}
	var syn syntax.Error
	if errors.As(err, &syn) {
		return &ScriptError{Pos: syn.Pos.String(), Msg: syn.Msg}
	}
	var res resolve.ErrorList
	if errors.As(err, &res) {
		msg := res[0].Msg
		if len(res) > 1 {
			msg += fmt.Sprintf(" (and %d more errors)", len(res)-1)
		}
		return &ScriptError{Pos: res[0].Pos.String(), Msg: msg}
	}
	var ev *starlark.EvalError
	if errors.As(err, &ev) {
		// The innermost frame in the script, not in a built-in such as len.
		pos := filename + ":1:1"
		for i := len(ev.CallStack) - 1; i >= 0; i-- {
			if p := ev.CallStack[i].Pos; p.IsValid() && p.Filename() == filename && p.Line > 0 {
				if calls != nil {
					// A failing call is reported at its start, "len(x)" not "(x)",
					// like the errors our own built-ins raise.
					p = calls.locate(p, nil)
				}
				pos = p.String()
				break
			}
		}
		return &ScriptError{Pos: pos, Msg: ev.Msg, err: errors.Unwrap(ev)}
	}
	return &ScriptError{Pos: filename + ":1:1", Msg: err.Error(), err: err}
}

// fString finds a Python f-string's opening: f"..., rf'..., and so on.
var fString = regexp.MustCompile(`(^|[^\w])[rR]?[fF][rR]?["']`)

// pythonHint says, for a syntax error that Python would have accepted, what
// Starlark lacks and what to write instead: the parser's own words ("got
// string literal, want newline") name a token, not the mistake. "" when
// the error is not one of those.
func pythonHint(syn syntax.Error, src []byte) string {
	lines := bytes.Split(src, []byte("\n"))
	line := ""
	if n := int(syn.Pos.Line); n >= 1 && n <= len(lines) {
		line = string(lines[n-1])
	}
	got, _, _ := strings.Cut(strings.TrimPrefix(syn.Msg, "got "), ",")
	switch {
	case strings.HasPrefix(syn.Msg, "got string literal") && fString.MatchString(line):
		return ` (Starlark has no f-strings: write "abl_%s" % x or "abl_{}".format(x))`
	case got == "'**'":
		return " (Starlark has no ** operator: multiply, or write the number, e.g. 1e-3)"
	case got == "import" || got == "from":
		return " (Starlark has no import: a script has the built-ins experiment, workload, grid and product, and Starlark's own, such as range, len and sorted)"
	case got == "raise":
		return ` (Starlark has no raise: fail("why") stops the script with a message)`
	case strings.HasPrefix(strings.TrimSpace(line), "assert "): // an identifier to Starlark, so the next token is what fails
		return ` (Starlark has no assert: write if not ...: fail("why"))`
	case got == "try" || got == "class" || got == "with" || got == "yield" || got == "global" || got == "nonlocal" || got == "del":
		return " (Starlark has no " + got + "; see https://github.com/bazelbuild/starlark/blob/master/spec.md)"
	}
	return ""
}
