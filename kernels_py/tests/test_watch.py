"""watch's compile figures: each config named, spills as kernels report
counts them, and a config the autotuner prunes for its spills marked so."""

from kernels_py.watch import compiled_kernels


def entry(kernel, registers, stores=0, loads=0, config=None, warps=4, stages=2, maxnreg=None):
    return {"kernel": kernel, "autotuned": config is not None, "config": config, "num_warps": warps,
            "num_stages": stages, "maxnreg": maxnreg, "registers": registers, "spill_stores": stores,
            "spill_loads": loads, "seconds": 0.5}


def test_a_spilling_config_beside_one_that_does_not_is_pruned():
    got = compiled_kernels([
        entry("_stage1_kernel", 128, config=[[["BLOCK_N", 128]], 4, 2]),
        entry("_stage1_kernel", 64, stores=352, loads=300, config=[[["BLOCK_N", 128]], 4, 2, 64], maxnreg=64),
        entry("_merge_kernel", 16),
    ])
    assert [(k["config"], k["spill_bytes"], k["pruned"]) for k in got] == [
        ("BLOCK_N=128 w4 s2", 0, False),
        ("BLOCK_N=128 w4 s2 r64", 352, True),  # the spill stores, as kernels report's spill column
        (None, 0, False),
    ]


def test_when_every_config_spills_none_is_pruned():
    # The autotuner then keeps the one spilling least, and a plain launch runs whatever it spills.
    got = compiled_kernels([
        entry("_stage1_kernel", 255, stores=8, config=[[["BLOCK_N", 64]], 4, 2]),
        entry("_stage1_kernel", 255, stores=40, config=[[["BLOCK_N", 128]], 4, 2]),
        entry("_plain_kernel", 255, stores=16),
    ])
    assert [k["pruned"] for k in got] == [False, False, False]
    assert [k["spill_bytes"] for k in got] == [8, 40, 16]
