"""Any NVIDIA kvpress press as a method: it runs inside a local VLM (a "vlm"
workload), where it compresses transformers' own cache after prefill
(kernels_py.models.presses); it has no replay on captured Q/K/V, since a
press reads the layer's module and hidden states."""

from dataclasses import dataclass
from typing import ClassVar

from kernels_py.methods.base import Method
from kernels_py.params import knob


@dataclass(frozen=True)
class KVPress(Method):
    """An NVIDIA kvpress press (SnapKV, TOVA, Expected Attention, KVzip, ...) inside the model's language model."""

    name = "kvpress"
    paper = "NVIDIA kvpress (github.com/NVIDIA/kvpress), kvpress==0.5.5"
    # Runs only inside a model: ablation.run gives it a "vlm" workload's generation (presses.generate with
    # make_press()) and no replay.
    in_model_only: ClassVar[bool] = True

    press: str = knob("str", "SnapKVPress", "the kvpress press class, e.g. SnapKVPress, TOVAPress, KnormPress "
                      "(`workbench methods kvpress` lists them with their parameters); none: no press, "
                      "transformers' own cache (kvpress's baseline)")
    compression_ratio: float = knob("float", 0.5, "share of the prompt's KV entries the press removes (kvpress's "
                                    "compression_ratio; 0.5 keeps half)", min=0.0, max=0.99)
    press_args: str = knob("str", "", "the press's own parameters, name=value pairs separated by commas (e.g. "
                           "window_size=32,kernel_size=5), checked against its constructor")
    inner_press: str = knob("str", "", "for a press that wraps another (AdaKVPress, KeyRerotationPress, ...): the "
                            "press it wraps, built with compression_ratio; ComposedPress's several, comma-separated, "
                            "are each built with it and applied in turn (two at 0.5 keep a quarter)")

    @classmethod
    def notes(cls) -> list[str]:
        try:
            from kernels_py.models import presses

            return [f"presses of kvpress {presses.version()} (press_args takes the parameters after the name):"] + \
                [f"  {line}" for line in presses.describe().split("; ")]
        except Exception as err:  # noqa: BLE001 - no kvpress in this Python: say so, list nothing
            return [f"kvpress is not importable here ({err})"]

    @classmethod
    def presses(cls) -> dict:
        try:
            from kernels_py.models import presses

            return presses.schema()
        except Exception:  # noqa: BLE001 - no kvpress in this Python: nothing to check names against
            return {}

    def make_press(self):
        from kernels_py.models import presses

        return presses.make(self.press, self.compression_ratio, presses.parse_args(self.press_args), self.inner_press)

    def prefill_all(self, q, k, v, spans):
        raise ValueError("method 'kvpress' runs inside a model: give it workload(\"vlm\", model=..., images=..., "
                         "prompt=...); a press reads the layer's module and hidden states, which a replayed trace "
                         "does not have")

    def decode(self, layer, cache, q_t, k_t, v_t):
        raise ValueError("method 'kvpress' runs inside a model (workload \"vlm\")")
