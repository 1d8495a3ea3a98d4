package tensor

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"

	"golang.org/x/sys/unix"
)

// Alignment is the least alignment of every allocation: a cache line, and
// enough for any vector load a kernel does on the host side.
const Alignment = 64

// ErrClosed is returned for operations on a closed arena.
var ErrClosed = errors.New("arena is closed")

// Arena is a shared-memory region (memfd_create + mmap) that tensors are
// allocated from. Its file descriptor can be handed to a worker, which maps
// the same pages; an Arena outlives any worker it was given to.
type Arena struct {
	id   uint32
	name string
	file *os.File
	data []byte

	mu     sync.Mutex
	free   []span          // free ranges, sorted by offset, coalesced
	allocs map[int64]int64 // offset -> size of each live allocation
	used   int64
	closed bool
}

type span struct{ off, size int64 }

// NewArena creates an arena of size bytes (rounded up to a page).
func NewArena(id uint32, name string, size int64) (*Arena, error) {
	if size <= 0 {
		return nil, fmt.Errorf("arena %q: size must be positive, got %d", name, size)
	}
	page := int64(os.Getpagesize())
	size = (size + page - 1) / page * page
	fd, err := unix.MemfdCreate("vlkv-"+name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("arena %q: memfd_create: %w", name, err)
	}
	file := os.NewFile(uintptr(fd), "memfd:vlkv-"+name)
	if err := unix.Ftruncate(fd, size); err != nil {
		file.Close()
		return nil, fmt.Errorf("arena %q: size to %d bytes: %w", name, size, err)
	}
	data, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		file.Close()
		return nil, fmt.Errorf("arena %q: mmap %d bytes: %w", name, size, err)
	}
	return &Arena{id: id, name: name, file: file, data: data,
		free: []span{{0, size}}, allocs: map[int64]int64{}}, nil
}

func (a *Arena) ID() uint32     { return a.id }
func (a *Arena) Name() string   { return a.name }
func (a *Arena) Size() int64    { return int64(len(a.data)) }
func (a *Arena) File() *os.File { return a.file }

// Closed reports whether Close was called.
func (a *Arena) Closed() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.closed
}

// Used is the number of bytes held by live allocations.
func (a *Arena) Used() int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.used
}

// Alloc reserves n bytes aligned to align (at least Alignment) and returns
// their offset. First fit over the free list.
func (a *Arena) Alloc(n, align int64) (int64, error) {
	if n <= 0 {
		n = 1 // empty tensors still get a distinct, valid offset
	}
	if align < Alignment {
		align = Alignment
	}
	if align&(align-1) != 0 {
		return 0, fmt.Errorf("alignment %d is not a power of two", align)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return 0, ErrClosed
	}
	// Checked before rounding up, which would overflow for n near MaxInt64
	// and hand out a negative size; the arena's size is a multiple of
	// Alignment, so n rounds up to no more than it.
	if n > int64(len(a.data)) {
		return 0, fmt.Errorf("arena %q: no room for %d bytes (%d of %d in use)", a.name, n, a.used, len(a.data))
	}
	n = (n + Alignment - 1) / Alignment * Alignment
	for i, s := range a.free {
		start := (s.off + align - 1) / align * align
		if start+n > s.off+s.size {
			continue
		}
		// Split the free span into what lies before and after the allocation.
		var rest []span
		if start > s.off {
			rest = append(rest, span{s.off, start - s.off})
		}
		if end := start + n; end < s.off+s.size {
			rest = append(rest, span{end, s.off + s.size - end})
		}
		a.free = append(a.free[:i], append(rest, a.free[i+1:]...)...)
		a.allocs[start] = n
		a.used += n
		return start, nil
	}
	return 0, fmt.Errorf("arena %q: no room for %d bytes (%d of %d in use)", a.name, n, a.used, len(a.data))
}

// Free releases the allocation at off.
func (a *Arena) Free(off int64) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	n, ok := a.allocs[off]
	if !ok {
		return fmt.Errorf("arena %q: no allocation at offset %d", a.name, off)
	}
	delete(a.allocs, off)
	a.used -= n
	i := sort.Search(len(a.free), func(i int) bool { return a.free[i].off > off })
	a.free = append(a.free[:i], append([]span{{off, n}}, a.free[i:]...)...)
	// Coalesce with the neighbours.
	if i+1 < len(a.free) && a.free[i].off+a.free[i].size == a.free[i+1].off {
		a.free[i].size += a.free[i+1].size
		a.free = append(a.free[:i+1], a.free[i+2:]...)
	}
	if i > 0 && a.free[i-1].off+a.free[i-1].size == a.free[i].off {
		a.free[i-1].size += a.free[i].size
		a.free = append(a.free[:i], a.free[i+1:]...)
	}
	return nil
}

// Bytes returns the arena's whole mapping. It is invalid after Close.
func (a *Arena) Bytes() []byte { return a.data }

// Close unmaps the arena and closes its descriptor. Workers that mapped it
// keep their own mapping until they drop it.
func (a *Arena) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil
	}
	a.closed = true
	err := unix.Munmap(a.data)
	a.data = nil
	if cerr := a.file.Close(); err == nil {
		err = cerr
	}
	return err
}

// NewTensor allocates a contiguous tensor of the given dtype and shape.
func (a *Arena) NewTensor(dt DType, shape ...int64) (*Tensor, error) {
	if err := dt.Valid(); err != nil {
		return nil, err
	}
	d := Descriptor{Arena: a.id, DType: dt, Shape: append([]int64(nil), shape...), Strides: ContiguousStrides(shape), Device: CPU}
	_, nbytes, err := d.Span() // offset 0: the end is the size
	if err != nil {
		return nil, fmt.Errorf("new %s tensor %v: %w", dt, shape, err)
	}
	off, err := a.Alloc(nbytes, Alignment)
	if err != nil {
		return nil, err
	}
	d.Offset = off
	return &Tensor{arena: a, desc: d, owned: true}, nil
}

// Tensor returns the tensor a descriptor names in this arena, after checking it.
func (a *Arena) Tensor(d Descriptor) (*Tensor, error) {
	if d.Arena != a.id {
		return nil, fmt.Errorf("descriptor names arena %d, not %d", d.Arena, a.id)
	}
	if err := d.Validate(a.Size()); err != nil {
		return nil, err
	}
	return &Tensor{arena: a, desc: d}, nil
}
