package worker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// The test binary doubles as a stand-in worker: started with
// VLKV_FAKE_WORKER set, it speaks the channel's protocol without Python, so
// the host's handling of how a worker ends can be tested in milliseconds
// and exactly (a reply written just before an exit, a process a job left
// running).
func TestMain(m *testing.M) {
	if mode := os.Getenv("VLKV_FAKE_WORKER"); mode != "" {
		os.Exit(fakeWorker(mode))
	}
	os.Exit(m.Run())
}

func fakeWorker(mode string) int {
	fds := strings.Split(os.Getenv("VLKV_WORKER_FDS"), ",")
	rxFd, _ := strconv.Atoi(fds[0])
	txFd, _ := strconv.Atoi(fds[1])
	rx, tx := os.NewFile(uintptr(rxFd), "rx"), os.NewFile(uintptr(txFd), "tx")
	version := "1"
	hello := map[string]any{"type": "hello", "pid": os.Getpid(), "torch": Package{Version: &version},
		"triton": Package{Version: &version}, "numpy": Package{Version: &version}, "device": map[string]string{"kind": "cpu"}}
	if mode == "refuse" {
		hello["error"] = "refused on purpose"
	}
	if mode == "slow" { // an import that takes longer than the host waits
		fmt.Println("importing torch")
		time.Sleep(time.Minute)
	}
	if err := WriteFrame(tx, hello); err != nil || mode == "refuse" {
		return 1
	}
	for {
		body, err := ReadFrame(rx)
		if err != nil {
			return 1
		}
		var msg message
		json.Unmarshal(body, &msg)
		reply := message{Type: "result", ID: msg.ID, Result: json.RawMessage(`{}`)}
		if msg.Type == "shutdown" {
			WriteFrame(tx, reply)
			return 0
		}
		switch msg.Job.Fn {
		case "reply_then_exit": // the reply is on its way when the process ends
			WriteFrame(tx, reply)
			return 0
		case "child_then_hang", "child_then_die": // a job that started a process, which outlives it
			child := exec.Command("sleep", "60")
			child.Stdout, child.Stderr = os.Stdout, os.Stderr
			if err := child.Start(); err != nil {
				return 1
			}
			os.WriteFile(msg.Job.Args["pidfile"].(string), []byte(strconv.Itoa(child.Process.Pid)), 0o644)
			if msg.Job.Fn == "child_then_die" {
				syscall.Kill(os.Getpid(), syscall.SIGKILL)
			}
			select {}
		default:
			WriteFrame(tx, reply)
		}
	}
}

func startFake(t *testing.T, mode string) (*Worker, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return Start(ctx, Config{Python: exe, KernelsRoot: t.TempDir(), Device: CPU, Log: zerolog.Nop(),
		Env: append(os.Environ(), "VLKV_FAKE_WORKER="+mode)})
}

// A worker that says no hello in time is reported as such, with how long
// the host waited and what it printed, not as a bare deadline.
func TestStartTimeoutSaysWhatItWaitedFor(t *testing.T) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = Start(context.Background(), Config{Python: exe, KernelsRoot: t.TempDir(), Device: CPU, Log: zerolog.Nop(),
		StartTimeout: 2 * time.Second, Env: append(os.Environ(), "VLKV_FAKE_WORKER=slow")})
	if err == nil {
		t.Fatal("a worker that never said hello started")
	}
	if took := time.Since(start); took > 30*time.Second {
		t.Errorf("the start gave up after %v", took)
	}
	for _, want := range []string{"no hello within 2s", "importing torch", "--start-timeout gives it longer"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}

// running says whether pid is a live process (not gone, not a zombie
// waiting for a reaper).
func running(pid int) bool {
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return false
	}
	fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	return len(fields) > 0 && fields[0] != "Z"
}

func childPid(t *testing.T, pidfile string) int {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if b, err := os.ReadFile(pidfile); err == nil && len(b) > 0 {
			pid, _ := strconv.Atoi(string(b))
			return pid
		}
	}
	t.Fatal("the job never said which process it started")
	return 0
}

// A job that times out is stopped with everything it started, and at
// once: a process it left running, holding the worker's output, must not
// keep the host waiting (it waited for that process to end by itself).
func TestTimeoutKillsWhatTheJobStarted(t *testing.T) {
	w, err := startFake(t, "ok")
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	pidfile := filepath.Join(t.TempDir(), "child")
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	start := time.Now()
	_, err = w.Run(ctx, Job{Fn: "child_then_hang", Args: map[string]any{"pidfile": pidfile}})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want a deadline error", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("the timeout took %v", took)
	}
	child := childPid(t, pidfile)
	for deadline := time.Now().Add(5 * time.Second); running(child) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if running(child) {
		syscall.Kill(child, syscall.SIGKILL)
		t.Error("the process the job started still runs after the job was stopped")
	}
}

// A worker that dies mid-job while a process it started holds its output
// is reported dead at once, not when that process ends.
func TestDeathWithAChildRunningIsReportedAtOnce(t *testing.T) {
	w, err := startFake(t, "ok")
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	pidfile := filepath.Join(t.TempDir(), "child")
	start := time.Now()
	_, err = w.Run(context.Background(), Job{Fn: "child_then_die", Args: map[string]any{"pidfile": pidfile}})
	defer syscall.Kill(childPid(t, pidfile), syscall.SIGKILL)
	var ee *ExitError
	if !errors.As(err, &ee) || !strings.Contains(ee.State, "killed") {
		t.Fatalf("got %v, want an *ExitError saying the worker was killed", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("the worker's death was reported after %v", took)
	}
}

// A reply the worker wrote before it exited is the job's result, however
// the host's reader and its reaper race.
func TestAReplyWrittenBeforeExitIsKept(t *testing.T) {
	for i := 0; i < 50; i++ {
		w, err := startFake(t, "ok")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Run(context.Background(), Job{Fn: "reply_then_exit"}); err != nil {
			t.Fatalf("try %d: the reply was lost: %v", i, err)
		}
		// The next job finds the worker dead and says so.
		for deadline := time.Now().Add(10 * time.Second); w.Alive() && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		var ee *ExitError
		if _, err := w.Run(context.Background(), Job{Fn: "echo"}); !errors.As(err, &ee) {
			t.Fatalf("try %d: a job on the exited worker: got %v, want an *ExitError", i, err)
		}
		w.Close()
	}
}

// A worker that refuses to start leaves no descriptor open behind it (the
// scheduler retries starts, and watch starts workers after every save).
func TestRefusedStartsLeaveNoDescriptors(t *testing.T) {
	open := func() int {
		entries, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Skip("no /proc/self/fd here")
		}
		return len(entries)
	}
	refuse := func() {
		var refused *RefusedError
		if _, err := startFake(t, "refuse"); !errors.As(err, &refused) {
			t.Fatalf("got %v, want a *RefusedError", err)
		}
	}
	refuse() // whatever the runtime opens once
	before := open()
	for i := 0; i < 10; i++ {
		refuse()
	}
	if after := open(); after > before+2 {
		t.Errorf("%d descriptors open after 10 refused starts, %d before", after, before)
	}
}
