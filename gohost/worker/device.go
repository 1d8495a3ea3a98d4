package worker

import (
	"fmt"
	"path/filepath"
	"strings"
)

// Device is where a worker runs its kernels.
type Device string

const (
	CPU  Device = "cpu"  // Triton kernels run under TRITON_INTERPRET=1
	CUDA Device = "cuda" // compiled Triton kernels on an NVIDIA GPU
	Auto Device = "auto" // CUDA when the host sees an NVIDIA GPU, else CPU
)

// ParseDevice accepts cpu, cuda or auto.
func ParseDevice(s string) (Device, error) {
	switch d := Device(strings.ToLower(strings.TrimSpace(s))); d {
	case CPU, CUDA, Auto:
		return d, nil
	}
	return "", fmt.Errorf("unknown device %q: want cpu, cuda or auto", s)
}

// ResolveDevice turns auto into cpu or cuda by looking for NVIDIA device
// nodes under devRoot ("/" on a real host), without starting Python.
// lookupEnv is os.LookupEnv outside tests.
func ResolveDevice(d Device, lookupEnv func(string) (string, bool), devRoot string) Device {
	if d != Auto {
		return d
	}
	if v, ok := lookupEnv("CUDA_VISIBLE_DEVICES"); ok {
		if v = strings.TrimSpace(v); v == "" || v == "-1" {
			return CPU
		}
	}
	if GPUs(devRoot) > 0 {
		return CUDA
	}
	return CPU
}

// GPUs counts the NVIDIA device nodes under devRoot ("/" on a real host).
func GPUs(devRoot string) int {
	nodes, _ := filepath.Glob(filepath.Join(devRoot, "dev", "nvidia[0-9]*"))
	return len(nodes)
}
