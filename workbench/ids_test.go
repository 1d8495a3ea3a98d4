package main

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"slices"
	"strings"
	"testing"
)

// Resumes and comparisons join runs on job ids, so the shipped experiments
// keep theirs across changes: a knob added at its default is left out of the
// ids (its schema entry's id_omits_default). A change meant to move them
// updates the digests below (sha256 of the sorted ids, one per line).
func TestShippedExperimentsKeepTheirJobIDs(t *testing.T) {
	tests := []struct {
		experiment string
		jobs       int
		digest     string
	}{
		{"quickstart", 10, "4bb293e6b89be30a"},
		{"attentionpack", 54, "4e5ca6be68264103"},
		{"methods_compare", 65, "1b270f721d4dd98f"},
		{"accuracy", 171, "07a7d9c4a68fcc82"},
	}
	for _, tt := range tests {
		t.Run(tt.experiment, func(t *testing.T) {
			code, stdout, stderr := runCLI(t, "plan", "--json", "../experiments/"+tt.experiment+".star")
			if code != 0 {
				t.Fatalf("plan: exit %d: %s", code, stderr)
			}
			var p struct{ Jobs []struct{ ID string } }
			if err := json.Unmarshal([]byte(stdout), &p); err != nil {
				t.Fatalf("plan --json: %v", err)
			}
			var ids []string
			for _, j := range p.Jobs {
				ids = append(ids, j.ID)
			}
			slices.Sort(ids)
			sum := sha256.Sum256([]byte(strings.Join(ids, "\n")))
			if got := hex.EncodeToString(sum[:])[:16]; len(ids) != tt.jobs || got != tt.digest {
				t.Errorf("%d jobs, ids digest %s; want %d jobs, %s (a new knob without id_omits_default?)",
					len(ids), got, tt.jobs, tt.digest)
			}
		})
	}
}
