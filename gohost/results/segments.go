package results

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// SegmentsDir holds journal segments: files of journal lines written by
// processes other than the run's writer (a cluster's tasks), one file per
// process, so that no two processes append to one file on a network
// filesystem. The run's writer merges them into journal.jsonl.
const SegmentsDir = "segments"

// Segment is one process's journal segment, opened for appending.
type Segment struct {
	f *os.File
}

// CreateSegment opens (or reopens, after a restart of the same task)
// dir/segments/name.jsonl for appending. A line torn by a crash at its end
// is cut off first.
func CreateSegment(dir, name string) (*Segment, error) {
	if !safeName.MatchString(name) {
		return nil, fmt.Errorf("segment name %q: want letters, digits, '.', '_' or '-'", name)
	}
	if err := os.MkdirAll(filepath.Join(dir, SegmentsDir), 0o755); err != nil {
		return nil, fmt.Errorf("create journal segment: %w", err)
	}
	path := SegmentPath(dir, name)
	if err := truncateTornLine(path); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_RDWR, 0o644) // read: appendLine checks what it cuts
	if err != nil {
		return nil, fmt.Errorf("create journal segment: %w", err)
	}
	return &Segment{f: f}, nil
}

// Append writes one record and fsyncs it, as Run.Append does.
func (s *Segment) Append(rec Record) error {
	line, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("journal job %s: %w", rec.JobID, err)
	}
	if err := appendLine(s.f, line); err != nil {
		return fmt.Errorf("journal job %s in %s: %w", rec.JobID, s.f.Name(), err)
	}
	return nil
}

// Close closes the segment.
func (s *Segment) Close() error { return s.f.Close() }

// ReadSegment returns the complete records of one segment file (a line
// still being written is left for later).
func ReadSegment(path string) ([]Record, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	recs, _, err := parseLines(path, data)
	return recs, err
}

// SegmentReader reads the records appended to a run's segments since its
// last call: what a run's writer merges while tasks are still writing.
type SegmentReader struct {
	dir     string
	prefix  string // only segments whose name starts with it ("": all)
	offsets map[string]int64
}

// NewSegmentReader reads dir's segments from their beginning.
func NewSegmentReader(dir string) *SegmentReader {
	return &SegmentReader{dir: dir, offsets: map[string]int64{}}
}

// NewSubmissionReader reads only the segments of one submission's tasks
// (SegmentName), so records of an earlier submission are not read again.
func NewSubmissionReader(dir, submission string) *SegmentReader {
	return &SegmentReader{dir: dir, prefix: segmentPrefix(submission), offsets: map[string]int64{}}
}

// Read returns the complete lines appended to any segment since the last
// Read, file by file in name order.
func (s *SegmentReader) Read() ([]Record, error) {
	paths, err := filepath.Glob(filepath.Join(s.dir, SegmentsDir, "*.jsonl"))
	if err != nil {
		return nil, err
	}
	sort.Strings(paths)
	var all []Record
	for _, path := range paths {
		if s.prefix != "" && !strings.HasPrefix(filepath.Base(path), s.prefix) {
			continue
		}
		recs, err := s.readFrom(path)
		if err != nil {
			return all, err
		}
		all = append(all, recs...)
	}
	return all, nil
}

func (s *SegmentReader) readFrom(path string) ([]Record, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if _, err := f.Seek(s.offsets[path], io.SeekStart); err != nil {
		return nil, err
	}
	data, err := io.ReadAll(f)
	if err != nil {
		return nil, err
	}
	recs, used, err := parseLines(path, data)
	s.offsets[path] += int64(used)
	return recs, err
}

// parseLines parses the complete (newline-ended) lines of data and says how
// many bytes they took.
func parseLines(path string, data []byte) ([]Record, int, error) {
	end := bytes.LastIndexByte(data, '\n') + 1
	var recs []Record
	for n, line := range bytes.Split(data[:end], []byte("\n")) {
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		var rec Record
		if err := json.Unmarshal(line, &rec); err != nil {
			return recs, end, fmt.Errorf("%s line %d: %w", path, n+1, err)
		}
		recs = append(recs, rec)
	}
	return recs, end, nil
}

// recordKey tells one journaled outcome from another: a job run twice
// (retried after a failure) has two.
func recordKey(rec Record) string {
	return rec.JobID + "\x00" + rec.Finished.UTC().Format(time.RFC3339Nano)
}

// Merger appends segment records to the run's journal, each once: those
// the journal already has (merged before this process started) are
// skipped.
type Merger struct {
	run    *Run
	reader *SegmentReader
	seen   map[string]bool
}

// NewMerger reads the run's journal to know what it has.
func (r *Run) NewMerger() (*Merger, error) {
	recs, err := ReadJournal(r.Dir)
	if err != nil {
		return nil, err
	}
	seen := make(map[string]bool, len(recs))
	for _, rec := range recs {
		seen[recordKey(rec)] = true
	}
	return &Merger{run: r, reader: NewSegmentReader(r.Dir), seen: seen}, nil
}

// Merge journals the segment records not journaled yet and returns them.
func (m *Merger) Merge() ([]Record, error) {
	recs, readErr := m.reader.Read()
	var merged []Record
	for _, rec := range recs {
		key := recordKey(rec)
		if m.seen[key] {
			continue
		}
		if err := m.run.Append(rec); err != nil {
			return merged, err
		}
		m.seen[key] = true
		merged = append(merged, rec)
	}
	return merged, readErr
}

// Recorded maps job ids to their last record in the run: the journal's,
// then those of its segments the journal lacks, in the order a Merger
// journals them. It reads and writes nothing else, so it tells what a run
// holds while tasks still write or before anyone merged their segments.
func Recorded(dir string) (map[string]Record, error) {
	recs, err := ReadJournal(dir)
	if err != nil {
		return nil, err
	}
	done := make(map[string]Record, len(recs))
	seen := make(map[string]bool, len(recs))
	for _, rec := range recs {
		done[rec.JobID] = rec
		seen[recordKey(rec)] = true
	}
	segs, err := NewSegmentReader(dir).Read()
	for _, rec := range segs {
		if !seen[recordKey(rec)] {
			done[rec.JobID] = rec
			seen[recordKey(rec)] = true
		}
	}
	return done, err
}

// SegmentPath is where the segment name of run dir lies.
func SegmentPath(dir, name string) string {
	return filepath.Join(dir, SegmentsDir, name+".jsonl")
}

// SegmentName is a task's segment: the submission and the task index.
func SegmentName(submission string, task int) string {
	return fmt.Sprintf("%s%d", segmentPrefix(submission), task)
}

func segmentPrefix(submission string) string {
	return strings.ReplaceAll(submission, "/", "_") + "-task"
}
