package results

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/gofrs/flock"
)

// LockedError is a run directory that another process is writing.
type LockedError struct {
	Dir    string
	Holder Holder // zero when the lock file could not be read
}

func (e *LockedError) Error() string {
	who := "another process"
	if e.Holder.PID > 0 {
		who = fmt.Sprintf("workbench process %d on %s (since %s)", e.Holder.PID, e.Holder.Host, e.Holder.Since.Local().Format(time.DateTime))
	}
	return fmt.Sprintf("run directory %s is being written by %s; two writers would duplicate jobs and race on the results. "+
		"Wait for it to finish (or stop it), then --resume", e.Dir, who)
}

// Holder is what run.lock says about the process holding it.
type Holder struct {
	PID   int       `json:"pid"`
	Host  string    `json:"host"`
	Since time.Time `json:"since"`
}

// Name is the holder as messages name it: "workbench process PID on HOST",
// or "another workbench" when the lock file did not say.
func (h Holder) Name() string {
	if h.PID > 0 {
		return fmt.Sprintf("workbench process %d on %s", h.PID, h.Host)
	}
	return "another workbench"
}

// lockDir takes the exclusive lock of a run directory, without waiting. The
// kernel releases it when the process ends, however it ends.
func lockDir(dir string) (*flock.Flock, error) {
	path := filepath.Join(dir, LockFile)
	l := flock.New(path)
	ok, err := l.TryLock()
	if err != nil {
		return nil, fmt.Errorf("lock run directory %s: %w", dir, err)
	}
	if !ok {
		var h Holder
		if data, err := os.ReadFile(path); err == nil {
			json.Unmarshal(data, &h)
		}
		return nil, &LockedError{Dir: dir, Holder: h}
	}
	host, _ := os.Hostname()
	data, _ := json.Marshal(Holder{PID: os.Getpid(), Host: host, Since: time.Now()})
	// The lock lives on the inode, so rewriting the file keeps it.
	if err := os.WriteFile(path, append(data, '\n'), 0o644); err != nil {
		l.Unlock()
		return nil, fmt.Errorf("lock run directory %s: %w", dir, err)
	}
	return l, nil
}

// NewRunLockFile, under an experiment's directory, serialises resumes that
// find no run of it to continue.
const NewRunLockFile = ".new-run.lock"

// LockNewRun takes the lock under which a resume that found no run of
// experiment starts one; the caller holds it until that run exists (or it
// gives up), so a second resume started alongside finds the run instead of
// starting another. It waits for the lock, calling waiting first if it has
// to, until ctx ends.
func LockNewRun(ctx context.Context, root, experiment string, waiting func()) (unlock func(), err error) {
	if !safeName.MatchString(experiment) {
		return nil, fmt.Errorf("experiment %q: want letters, digits, '.', '_' or '-'", experiment)
	}
	dir := filepath.Join(root, experiment)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("lock new run of %s: %w", experiment, err)
	}
	l := flock.New(filepath.Join(dir, NewRunLockFile))
	ok, err := l.TryLock()
	if err == nil && !ok {
		if waiting != nil {
			waiting()
		}
		ok, err = l.TryLockContext(ctx, 50*time.Millisecond)
	}
	if err != nil || !ok {
		return nil, fmt.Errorf("lock new run of %s: %w", experiment, err)
	}
	return func() { l.Unlock() }, nil
}

// Writer says whether another process holds dir's lock, and who, without
// taking it for more than a moment or creating anything: a run with no
// lock file has no writer.
func Writer(dir string) (Holder, bool) {
	path := filepath.Join(dir, LockFile)
	if _, err := os.Stat(path); err != nil {
		return Holder{}, false
	}
	l := flock.New(path)
	ok, err := l.TryLock()
	if err != nil {
		return Holder{}, false
	}
	if ok {
		l.Unlock()
		return Holder{}, false
	}
	var h Holder
	if data, err := os.ReadFile(path); err == nil {
		json.Unmarshal(data, &h)
	}
	return h, true
}
