"""The loader's weights checks at their words (in-process, a compiled example
module with separate weights)."""
from __future__ import annotations

import numpy as np
import pytest

from dspx.device.core import loader
from dspx.device.core.errors import WeightsError


@pytest.fixture(scope="module")
def separate(compiled):
    return compiled("multi_output", separate=True)


def test_parsed_weights_name_every_tensor_and_count_their_bytes(separate):
    w = loader.parse_weights((separate / "weights.bin").read_bytes())
    arrays = [t.numpy() for t in w.tensors]
    assert len(w.names) == w.num_constants == len(arrays) > 0 and all(isinstance(n, str) and n for n in w.names)
    assert w.nbytes == sum(a.nbytes for a in arrays) and isinstance(w.digest, str) and w.digest


def test_weights_refusals_say_why(separate, compiled):
    mod = loader.load_module((separate / "model.so").read_bytes())
    own = loader.load_module((compiled("multi_output") / "model.so").read_bytes())
    try:
        other = loader.parse_weights((compiled("multi_input", separate=True) / "weights.bin").read_bytes())
        with pytest.raises(WeightsError) as e:
            mod.check_weights(other)
        text = str(e.value)
        assert text.startswith("weights ") and (text.endswith("tensors, the module expects "
                                                              f"{mod.signature.num_weights}")
                                               or text.endswith("these weights belong to another model")), text
        with pytest.raises(WeightsError) as e:
            own.check_weights(loader.parse_weights((separate / "weights.bin").read_bytes()))
        assert str(e.value) == "module carries its own weights; it takes no weights file"
        good = loader.parse_weights((separate / "weights.bin").read_bytes())
        mod.check_weights(good)
        assert mod.set_weights((separate / "weights.bin").read_bytes()) == good.num_constants
        assert np.isfinite(mod.run([np.zeros(t.shape, t.dtype) for t in mod.signature.inputs])[0]).all()
    finally:
        mod.unload()
        own.unload()
