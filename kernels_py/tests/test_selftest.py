from kernels_py import selftest


def test_selftest_passes_its_own_check():
    result = selftest.run(heads=4, kv_heads=2, visual_tokens=64, text_tokens=16)
    assert result["ok"], result
    assert result["top_kernel_tokens"] == result["salient_tokens"]
    # Each post-vision row is a distribution over the keys it sees.
    assert abs(sum(s["kernel_share"] for s in result["segments"]) - 1.0) < 1e-4, result["segments"]
