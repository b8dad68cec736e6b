"""In-process tests: Checkpoints from an untrusted source: a crafted pickle in any file of a
checkpoint (with a manifest that matches it, as its author can write one) runs no code on resume
(a named ... The whole story, and the tests that start processes:
tests/e2e/test_safe_artifacts.py."""


import pickle

import pytest
import torch
from support.safe_artifacts_shared import RunsCommand, _payloads, _why

from fp8train.checkpoint.safe_load import DCP_METADATA_GLOBALS, unsafe_content
from fp8train.errors import BadInput


def test_the_payload_is_live(tmp_path):
    """What the checks stop: unpickled without restriction, as Accelerate's load_state read
    custom_checkpoint_N.pkl (format 1's TrainState, torch.load(weights_only=False)) and as TE
    still reads `_extra_state`, the payload runs. Accelerate's loader of optimizer.bin and
    random_states_N.pkl (weights_only=True) refuses it."""
    from accelerate.utils.other import load  # as accelerate.checkpointing loads those files
    marker = tmp_path / "MARKER"
    path = tmp_path / "random_states_0.pkl"
    torch.save(_payloads(marker)["random_states_0.pkl"][0], path)
    with pytest.raises(pickle.UnpicklingError, match="posix.system"):
        load(str(path), map_location="cpu")
    assert not marker.exists()
    path = tmp_path / "custom_checkpoint_0.pkl"
    torch.save(_payloads(marker)["custom_checkpoint_0.pkl"][0], path)
    load(str(path), map_location="cpu", weights_only=False).close()
    assert marker.exists()


def test_static_scan_sees_through_pickle_tricks():
    # STACK_GLOBAL (protocol 4) with the names memoized and fetched again
    ok = b"\x80\x04\x8c\x0bcollections\x94\x8c\x0bOrderedDict\x94\x93h\x00h\x01\x93)R."
    assert _why(ok) is None
    assert "os.OrderedDict" in _why(b"\x80\x04\x8c\x02os\x94\x8c\x0bOrderedDict\x94\x93.")
    # a module name computed by an allowed call, then imported
    computed = b"\x80\x04\x8c\x0bcollections\x8c\x0bOrderedDict\x93)R\x8c\x06system\x93."
    assert "computes" in _why(computed)
    assert "_codecs.encode" in _why(b"\x80\x02c_codecs\nencode\nX\x02\x00\x00\x00os"
                                    b"X\x05\x00\x00\x00rot13\x86R.")
    assert "EXT1" in _why(b"\x80\x02\x82\x01.")                  # the copyreg extension registry
    assert "not an object" in _why(b"\x80\x02ctorch\nfloat32\n}b.", DCP_METADATA_GLOBALS)  # BUILD
    assert "not an object" in _why(b"\x80\x02ccollections\nOrderedDict\n}b.")  # on a global
    assert "readable" in _why(b"\x80\x02(K\x01")                  # truncated
    assert _why(pickle.dumps({"a": [1, 2.0, "x", b"y", (1,)]}, protocol=5)) is None
    assert "posix.system" in _why(pickle.dumps(RunsCommand("true"), protocol=0))   # INST era


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_and_items_are_checked(tmp_path):
    import torch.distributed.checkpoint as dcp

    from fp8train.evaluate.trained import read_state
    marker = tmp_path / "MARKER"
    ckpt = tmp_path / "ckpt"
    sharded = ckpt / "pytorch_model_fsdp_0"
    # a non-tensor item: DCP itself loads it with torch.load(weights_only=False)
    dcp.save({"model": {"w": torch.ones(2), "n": RunsCommand(f"touch '{marker}'")}},
             storage_writer=dcp.FileSystemWriter(str(sharded)))
    why = unsafe_content(str(ckpt))
    assert "pytorch_model_fsdp_0/.metadata" in why and "item 'model.n'" in why \
        and "posix.system" in why
    with pytest.raises(BadInput, match="posix.system"):
        read_state(str(ckpt))
    # the metadata itself: DCP reads it with pickle.load
    (sharded / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch '{marker}'")))
    assert "posix.system" in unsafe_content(str(ckpt))
    with pytest.raises(BadInput, match="posix.system"):
        read_state(str(ckpt))
    assert not marker.exists()
