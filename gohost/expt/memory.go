package expt

import (
	"fmt"
	"os"
	"runtime"
	"runtime/metrics"
	"strconv"
	"sync/atomic"
	"time"

	"go.starlark.net/starlark"
)

// DefaultMaxMemory is how much heap one script evaluation may grow by
// before it is stopped; MaxMemoryEnv, a number of MiB, overrides it. A
// plan of MaxJobs jobs takes under 300 MiB; a value doubled in a loop
// reaches the limit within a second (and the step that crosses it may
// take as much again) where it would otherwise run the machine out of
// memory, which ends the CLI with no message.
const (
	DefaultMaxMemory = 1 << 30
	MaxMemoryEnv     = "VLKV_SCRIPT_MEMORY"
)

// memoryPoll is how often the heap is read while a script runs: one
// Starlark step can copy a large value, so the check cannot wait for a
// step count, and a millisecond is short enough that no series of steps
// gets far past the budget before it is seen.
const memoryPoll = time.Millisecond

// heapMetric counts the bytes of heap objects, live or not yet swept. It
// is updated as objects are allocated, so a large string shows at once.
const heapMetric = "/memory/classes/heap/objects:bytes"

// maxMemory is the budget MaxMemoryEnv sets, else DefaultMaxMemory.
func maxMemory() (uint64, error) {
	v, ok := os.LookupEnv(MaxMemoryEnv)
	if !ok || v == "" {
		return DefaultMaxMemory, nil
	}
	mib, err := strconv.ParseUint(v, 10, 32)
	if err != nil || mib == 0 {
		return 0, fmt.Errorf("expt: %s=%q: want a positive number of MiB", MaxMemoryEnv, v)
	}
	return mib << 20, nil
}

// memoryWatch cancels thread once the heap has grown by more than limit
// bytes since the watch began. Stop ends it; Exceeded says whether it
// cancelled the thread.
type memoryWatch struct {
	limit    uint64
	done     chan struct{}
	stopped  chan struct{}
	exceeded atomic.Bool
}

func watchMemory(thread *starlark.Thread, limit uint64) *memoryWatch {
	w := &memoryWatch{limit: limit, done: make(chan struct{}), stopped: make(chan struct{})}
	sample := []metrics.Sample{{Name: heapMetric}}
	read := func() uint64 {
		metrics.Read(sample)
		return sample[0].Value.Uint64()
	}
	// Garbage from before the script would count until swept, and might
	// be swept while the script grows: start from the live heap.
	runtime.GC()
	base := read()
	go func() {
		defer close(w.stopped)
		tick := time.NewTicker(memoryPoll)
		defer tick.Stop()
		for {
			select {
			case <-w.done:
				return
			case <-tick.C:
				if heap := read(); heap > base && heap-base > limit {
					w.exceeded.Store(true)
					thread.Cancel("out of memory")
					return
				}
			}
		}
	}()
	return w
}

// Stop ends the watch and waits for it, so Exceeded is final.
func (w *memoryWatch) Stop() {
	close(w.done)
	<-w.stopped
}

func (w *memoryWatch) Exceeded() bool { return w.exceeded.Load() }

func (w *memoryWatch) message() string {
	return fmt.Sprintf("script used more than %d MiB of memory (a value that grows without bound?); %s=MiB sets the limit",
		w.limit>>20, MaxMemoryEnv)
}
