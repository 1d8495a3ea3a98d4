package results

import (
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
