// Package vlkv holds the files a workbench binary carries so that it runs
// outside a checkout: the kernels_py package and the Python project
// (pyproject.toml + uv.lock) that pins the runtime's dependencies.
package vlkv

import "embed"

// Assets is rooted at the repository root: kernels_py/..., experiments/*.star,
// pyproject.toml, uv.lock, notebooks/*.ipynb.
// "all:" keeps __init__.py files, which plain directory embeds would skip.
//
//go:embed all:kernels_py pyproject.toml uv.lock experiments/*.star notebooks/*.ipynb
var Assets embed.FS
