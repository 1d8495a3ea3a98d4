package main

import (
	"context"
	"fmt"
	"os/exec"
	"sort"

	vlkv "github.com/vlkv/vlkv"
	"github.com/vlkv/vlkv/gohost/pyrt"
)

// workloadGroups maps a workload to the dependency group of the lock it
// needs beyond the runtime: installed on the first run that uses it.
var workloadGroups = map[string]struct{ group, module string }{
	"lmms": {group: "lmms", module: "lmms_eval"},
}

// ensureWorkloadGroups installs the dependency groups that the workloads
// named need into the managed runtime (once; a marker in the venv records
// it), or, with --python, checks that the interpreter has them.
func (a *app) ensureWorkloadGroups(ctx context.Context, s *session, workloads []string) error {
	seen := map[string]bool{}
	for _, name := range workloads {
		need, ok := workloadGroups[name]
		if !ok || seen[need.group] {
			continue
		}
		seen[need.group] = true
		if s.runtime.Kind != pyrt.Managed {
			if err := exec.CommandContext(ctx, s.runtime.Python, "-c", "import "+need.module).Run(); err != nil {
				return fmt.Errorf("workload %q needs %s, which is not installed in %s (from %s): install the "+
					"version uv.lock pins in its %s group there, or run without --python to use the managed runtime, "+
					"which installs it on first use", name, need.module, s.runtime.Python, s.runtime.Source, need.group)
			}
			continue
		}
		if err := a.installGroup(ctx, s, need.group); err != nil {
			return err
		}
	}
	return nil
}

// installGroup installs a dependency group of the lock into the session's
// managed runtime, once (pyrt.EnsureGroup).
func (a *app) installGroup(ctx context.Context, s *session, group string) error {
	cacheDir, err := pyrt.CacheDir()
	if err != nil {
		return err
	}
	project, err := pyrt.ProjectFor(s.kernels, vlkv.Assets)
	if err != nil {
		return err
	}
	cfg := pyrt.ManagedConfig{CacheDir: cacheDir, Project: project, Log: a.log, Progress: a.stderr}
	return pyrt.EnsureGroup(ctx, cfg, s.runtime, group)
}

// sortedGroupWorkloads names the workloads that need a dependency group.
func sortedGroupWorkloads() []string {
	var names []string
	for name := range workloadGroups {
		names = append(names, name)
	}
	sort.Strings(names)
	return names
}
