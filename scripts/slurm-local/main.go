// Command slurm-local starts a single-node Slurm on this machine, the one
// the tests use (gohost/slurm/slurmtest), to try `workbench run --executor
// slurm` without a cluster: munged, slurmctld and slurmd from Debian's
// munge and slurm-wlm packages, run as root, with one partition. It prints
// the SLURM_CONF to export and runs until Ctrl-C, which cancels its jobs and
// stops the daemons.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/vlkv/vlkv/gohost/slurm/slurmtest"
)

func main() {
	dir := flag.String("dir", "", "directory for the cluster's state, logs and slurm.conf (default: a temporary one, removed on exit)")
	flag.Parse()
	if err := run(*dir); err != nil {
		fmt.Fprintf(os.Stderr, "slurm-local: %v\n", err)
		os.Exit(1)
	}
}

func run(dir string) error {
	if dir == "" {
		tmp, err := os.MkdirTemp("", "vlkv-slurm-local-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		dir = tmp
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	c, err := slurmtest.Start(dir)
	if err != nil {
		return err
	}
	defer c.Stop()
	fmt.Printf(`A single-node Slurm runs (partition %[1]s; logs in %[2]s/log). In another shell, as root:

    export SLURM_CONF=%[3]s
    sinfo
    bin/workbench run experiments/quickstart.star --executor slurm --partition %[1]s --out /tmp/vlkv-results

Ctrl-C here cancels its jobs and stops it.
`, slurmtest.Partition, dir, c.Conf)
	<-ctx.Done()
	fmt.Println("stopping the cluster")
	return nil
}
