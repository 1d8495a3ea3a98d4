package runner

import (
	"crypto/sha256"
	"encoding/hex"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/vlkv/vlkv/gohost/results"
	"github.com/vlkv/vlkv/gohost/worker"
)

// newManifest describes a new run of o: enough to tell later what code ran
// it (script hash, git state, kernels_py hashes) and on what.
func newManifest(o Options, now time.Time, kernels map[string]string, digest string) results.Manifest {
	return results.Manifest{
		Experiment: o.Experiment, RunID: results.NewRunID(now), File: o.File, FileHash: o.FileHash,
		Git: gitState(o.KernelsDir), KernelsHash: kernels, KernelsDigest: digest, Device: o.Device,
		Jobs: len(o.Jobs), Started: now, Protocol: o.Protocol, Dtypes: workloadDtypes(o.Jobs),
		Scripts:  []results.Script{{At: now, File: o.File, FileHash: o.FileHash, Jobs: len(o.Jobs)}},
		Versions: map[string]string{"workbench": o.Version, "go": runtime.Version()},
	}
}

// workloadDtypes are the dtypes the jobs' workloads run in, sorted, from
// their "dtype" knob: what every byte count and ratio is measured against.
func workloadDtypes(jobs []Job) []string {
	seen := map[string]bool{}
	for _, j := range jobs {
		if d, ok := j.Workload["dtype"].(string); ok {
			seen[d] = true
		}
	}
	return slices.Sorted(maps.Keys(seen))
}

// recordVersions adds what a worker runs on to the manifest. A manifest
// that cannot be rewritten keeps the versions it had: the run goes on.
func recordVersions(run *results.Run, h worker.Hello) {
	run.UpdateManifest(func(m *results.Manifest) {
		set := func(k string, v *string) {
			if v != nil {
				m.Versions[k] = *v
			}
		}
		m.Versions["python"] = h.Python.Version
		set("torch", h.Torch.Version)
		set("triton", h.Triton.Version)
		set("numpy", h.Numpy.Version)
		// A resume's worker names the devices again: once is enough.
		if names := " (" + strings.Join(h.Device.Names, ", ") + ")"; len(h.Device.Names) > 0 && !strings.HasSuffix(m.Device, names) {
			m.Device += names
		}
	})
}

// gitState is the checkout dir belongs to; nil outside one.
func gitState(dir string) *results.Git {
	out, err := exec.Command("git", "-C", dir, "rev-parse", "HEAD").Output()
	if err != nil {
		return nil
	}
	g := &results.Git{Commit: strings.TrimSpace(string(out))}
	status, _ := exec.Command("git", "-C", dir, "status", "--porcelain").Output()
	for _, line := range strings.Split(string(status), "\n") {
		switch {
		case strings.HasPrefix(line, "??"):
			g.Untracked = true
		case strings.TrimSpace(line) != "":
			g.Dirty = true
		}
	}
	return g
}

// kernelsHashes fingerprints the kernels_py sources a run used, by path
// relative to kernels_py/: the kernels may come from no git checkout at all
// (the copy embedded in the binary), and a dirty checkout's commit says
// little. The tests are left out: editing one changes no result.
// KernelsDigestOf is the digest of the kernels_py sources under root (what
// a run records), and their per-file hashes.
func KernelsDigestOf(root string) (string, map[string]string) {
	hashes := kernelsHashes(root)
	return results.KernelsDigest(hashes), hashes
}

func kernelsHashes(root string) map[string]string {
	hashes := map[string]string{}
	base := filepath.Join(root, "kernels_py")
	filepath.WalkDir(base, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() && (d.Name() == "tests" || d.Name() == "__pycache__") {
			return fs.SkipDir
		}
		if err != nil || d.IsDir() || !(strings.HasSuffix(p, ".py") || strings.HasSuffix(p, ".json")) {
			return nil
		}
		data, err := os.ReadFile(p)
		if err == nil {
			rel, _ := filepath.Rel(base, p)
			sum := sha256.Sum256(data)
			hashes[rel] = hex.EncodeToString(sum[:])
		}
		return nil
	})
	return hashes
}
