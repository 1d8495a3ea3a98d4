package worker

import (
	"bytes"
	"strings"
	"testing"

	"github.com/rs/zerolog"
)

func TestLineLoggerLevels(t *testing.T) {
	tests := []struct {
		name  string
		level zerolog.Level
		input string
		want  []string // substrings of the log, in order
		not   []string
	}{
		{"progress at info", zerolog.InfoLevel, "noise\nvlkv progress: row 1 of 2\n", []string{`"level":"info"`, `"message":"row 1 of 2"`}, []string{"noise"}},
		{"everything with -v", zerolog.DebugLevel, "noise\nvlkv progress: done\n", []string{`"message":"noise"`, `"message":"done"`}, nil},
		{"partial lines wait", zerolog.InfoLevel, "vlkv progress: half", nil, []string{"half"}},
		{"quiet drops progress too", zerolog.WarnLevel, "vlkv progress: row\n", nil, []string{"row"}},
		{"a carriage return ends a line", zerolog.DebugLevel, " 10%|#\r 20%|##\rdone\r\n",
			[]string{`"message":" 10%|#"`, `"message":" 20%|##"`, `"message":"done"`}, []string{`"message":""`}},
		{"an unended line is cut", zerolog.DebugLevel, strings.Repeat("x", maxLineBytes+5),
			[]string{`"message":"` + strings.Repeat("x", maxLineBytes) + `"`}, []string{`"message":"xxxxx"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			w := lineLogger(zerolog.New(&buf).Level(tt.level), "stderr")
			if _, err := w.Write([]byte(tt.input)); err != nil {
				t.Fatal(err)
			}
			got := buf.String()
			rest := got
			for _, want := range tt.want {
				i := strings.Index(rest, want)
				if i < 0 {
					t.Fatalf("log %q lacks %q (in order)", got, want)
				}
				rest = rest[i+len(want):]
			}
			for _, not := range tt.not {
				if strings.Contains(got, not) {
					t.Errorf("log %q holds %q", got, not)
				}
			}
		})
	}
}

func TestLineLoggerHoldsLittleOfAnUnendedLine(t *testing.T) {
	w := lineLogger(zerolog.Nop(), "stderr").(*lineWriter)
	chunk := bytes.Repeat([]byte("x"), 1000)
	for i := 0; i < 1000; i++ { // 1 MB, no line end
		w.Write(chunk)
	}
	if len(w.pending) >= maxLineBytes {
		t.Errorf("holds %d bytes of an unended line, want under %d", len(w.pending), maxLineBytes)
	}
}
