// Package slurmtest starts a single-node Slurm cluster for tests: munged,
// slurmctld and slurmd from Debian's slurm-wlm and munge packages, with a
// temporary configuration naming this machine as the only node, run as
// root. It starts in seconds.
package slurmtest

import (
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
)

// RequireEnv names the variable that makes a missing Slurm a test failure
// instead of a skip (CI sets it).
const RequireEnv = "VLKV_REQUIRE_SLURM"

// Partition is the cluster's default partition; HiddenPartition a hidden
// one (sites hide partitions some users may use), which sinfo lists to
// users other than root and SlurmUser only with --all.
const (
	Partition       = "debug"
	HiddenPartition = "hidden"
)

// Cluster is a running single-node Slurm.
type Cluster struct {
	Dir  string // its state, logs and configuration
	Conf string // slurm.conf: commands find it through SLURM_CONF
	// Hidden is a directory the node does not see: its jobs find an empty
	// filesystem there (slurmd runs in its own mount namespace), as on a
	// cluster whose nodes do not mount a host's local disk. "" when this
	// machine cannot make one (HiddenErr says why).
	Hidden    string
	HiddenErr error
	procs     []*exec.Cmd
}

// Start starts a cluster under dir (which it creates). Its commands need
// SLURM_CONF=c.Conf in their environment (Env).
func Start(dir string) (*Cluster, error) {
	for _, name := range []string{"munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel"} {
		if _, err := exec.LookPath(name); err != nil {
			return nil, fmt.Errorf("%s is not installed (Debian: apt-get install slurm-wlm munge)", name)
		}
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("a test Slurm runs its daemons as root")
	}
	c := &Cluster{Dir: dir, Conf: filepath.Join(dir, "slurm.conf")}
	for _, sub := range []string{"state", "spool", "log", "munge"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o700); err != nil {
			return nil, err
		}
	}
	key := make([]byte, 1024)
	rand.Read(key)
	keyFile := filepath.Join(dir, "munge", "munge.key")
	if err := os.WriteFile(keyFile, key, 0o600); err != nil {
		return nil, err
	}
	socket := filepath.Join(dir, "munge", "munge.socket")
	host, err := os.Hostname()
	if err != nil {
		return nil, err
	}
	host, _, _ = strings.Cut(host, ".")
	ports, err := freePorts(2)
	if err != nil {
		return nil, err
	}
	conf := fmt.Sprintf(`ClusterName=vlkvtest
SlurmctldHost=%[1]s
SlurmctldPort=%[2]d
SlurmdPort=%[3]d
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=%[4]s
StateSaveLocation=%[5]s/state
SlurmdSpoolDir=%[5]s/spool
SlurmctldPidFile=%[5]s/slurmctld.pid
SlurmdPidFile=%[5]s/slurmd.pid
SlurmctldLogFile=%[5]s/log/slurmctld.log
SlurmdLogFile=%[5]s/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
InactiveLimit=0
MinJobAge=300
KillWait=2
NodeName=%[1]s CPUs=%[6]d State=UNKNOWN
PartitionName=%[7]s Nodes=%[1]s Default=YES MaxTime=INFINITE State=UP
PartitionName=%[8]s Nodes=%[1]s MaxTime=INFINITE State=UP Hidden=YES
`, host, ports[0], ports[1], socket, dir, runtime.NumCPU(), Partition, HiddenPartition)
	if err := os.WriteFile(c.Conf, []byte(conf), 0o644); err != nil {
		return nil, err
	}
	starts := [][]string{
		{"munged", "--foreground", "--force", "--socket=" + socket, "--key-file=" + keyFile,
			"--log-file=" + filepath.Join(dir, "log", "munged.log"), "--pid-file=" + filepath.Join(dir, "munge", "pid"),
			"--seed-file=" + filepath.Join(dir, "munge", "seed")},
		{"slurmctld", "-D", "-i", "-f", c.Conf},
		{"slurmd", "-D", "-f", c.Conf},
	}
	c.Hidden = filepath.Join(dir, "hidden")
	if err := os.MkdirAll(c.Hidden, 0o755); err != nil {
		return nil, err
	}
	if c.HiddenErr = exec.Command("unshare", "--mount", "--propagation", "private", "true").Run(); c.HiddenErr == nil {
		starts[2] = []string{"unshare", "--mount", "--propagation", "private", "sh", "-c",
			`mount -t tmpfs none "$0" && exec slurmd -D -f "$1"`, c.Hidden, c.Conf}
	} else {
		c.HiddenErr = fmt.Errorf("unshare --mount: %w", c.HiddenErr)
		c.Hidden = ""
	}
	for i, args := range starts {
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Env = c.Env(os.Environ())
		log, err := os.Create(filepath.Join(dir, "log", fmt.Sprintf("daemon-%d.out", i)))
		if err != nil {
			c.Stop()
			return nil, err
		}
		cmd.Stdout, cmd.Stderr = log, log
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := cmd.Start(); err != nil {
			c.Stop()
			return nil, fmt.Errorf("start %s: %w", args[0], err)
		}
		c.procs = append(c.procs, cmd)
		if i == 0 {
			if err := waitFor(func() bool { _, err := os.Stat(socket); return err == nil }, 10*time.Second); err != nil {
				c.Stop()
				return nil, fmt.Errorf("munged did not start: %s", c.tail("munged.log"))
			}
		}
	}
	ready := func() bool {
		out, err := c.Command("sinfo", "-h", "-o", "%t").Output()
		return err == nil && strings.TrimSpace(string(out)) == "idle"
	}
	if err := waitFor(ready, 60*time.Second); err != nil {
		c.Stop()
		return nil, fmt.Errorf("the node did not become idle: %s", c.tail("slurmctld.log"))
	}
	return c, nil
}

// Env adds SLURM_CONF to env.
func (c *Cluster) Env(env []string) []string {
	return append(env, "SLURM_CONF="+c.Conf)
}

// Command is a Slurm command on this cluster.
func (c *Cluster) Command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	cmd.Env = c.Env(os.Environ())
	return cmd
}

// Stop cancels every job and stops the daemons.
func (c *Cluster) Stop() {
	if len(c.procs) == 3 {
		c.Command("scancel", "--user=root").Run()
		time.Sleep(500 * time.Millisecond)
	}
	for i := len(c.procs) - 1; i >= 0; i-- {
		p := c.procs[i]
		syscall.Kill(-p.Process.Pid, syscall.SIGTERM)
		done := make(chan struct{})
		go func() { p.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
			<-done
		}
	}
	c.procs = nil
}

func (c *Cluster) tail(log string) string {
	data, _ := os.ReadFile(filepath.Join(c.Dir, "log", log))
	if len(data) > 2000 {
		data = data[len(data)-2000:]
	}
	return string(data)
}

// Need returns the cluster for a test, or skips it with the reason the
// cluster could not start; with RequireEnv set it fails instead.
func Need(t testing.TB, c *Cluster, startErr error) *Cluster {
	t.Helper()
	if startErr == nil {
		t.Setenv("SLURM_CONF", c.Conf)
		return c
	}
	if os.Getenv(RequireEnv) != "" {
		t.Fatalf("no test Slurm (%s is set, so this fails instead of skipping): %v", RequireEnv, startErr)
	}
	t.Skipf("no test Slurm: %v", startErr)
	return nil
}

func freePorts(n int) ([]int, error) {
	var ports []int
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for len(ports) < n {
		l, err := net.Listen("tcp", ":0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

func waitFor(ok func() bool, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) {
		if ok() {
			return nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	return errors.New("timed out")
}
