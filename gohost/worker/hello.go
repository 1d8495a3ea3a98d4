package worker

// Hello is the first message a worker sends: what it runs on.
type Hello struct {
	Type   string `json:"type"`
	Pid    int    `json:"pid"`
	Python struct {
		Version    string `json:"version"`
		Executable string `json:"executable"`
		Prefix     string `json:"prefix"`
		Headers    struct {
			Include string `json:"include"`
			Present bool   `json:"present"`
		} `json:"headers"`
	} `json:"python"`
	Torch          Package `json:"torch"`
	Triton         Package `json:"triton"`
	Numpy          Package `json:"numpy"`
	KernelsRoot    string  `json:"kernels_root"`
	Interpreter    bool    `json:"interpreter"`
	TritonCacheDir string  `json:"triton_cache_dir"`
	Device         struct {
		Kind          string   `json:"kind"`
		CUDAAvailable bool     `json:"cuda_available"`
		TorchCUDA     *string  `json:"torch_cuda"`
		Names         []string `json:"names"`
	} `json:"device"`
	// Kernels is the kernels_py sources the worker runs; nil from a worker
	// that does not say.
	Kernels *Kernels `json:"kernels,omitempty"`
	Error   string   `json:"error,omitempty"`
}

// Kernels names kernels_py sources: per-file sha256 by path relative to
// kernels_py/, and one digest of them (results.KernelsDigest). A worker
// hashes each module from the bytes it compiles, so these are the sources
// it ran, not those on disk when the host looked.
type Kernels struct {
	Digest string            `json:"digest"`
	Files  map[string]string `json:"sha256"`
}

// Package is an imported Python package's version, or why it failed to import.
type Package struct {
	Version *string `json:"version"`
	Error   string  `json:"error,omitempty"`
}

// MissingPackage is the first of triton and numpy the worker could not
// import (torch it imports before it says hello), and what importing it
// raised; "" when both imported.
func (h Hello) MissingPackage() (name, why string) {
	for _, p := range []struct {
		name string
		pkg  Package
	}{{"triton", h.Triton}, {"numpy", h.Numpy}} {
		if p.pkg.Error != "" {
			return p.name, p.pkg.Error
		}
	}
	return "", ""
}
