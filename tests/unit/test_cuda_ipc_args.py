"""The cuda_ipc tier reads torch's CUDA tensor reduction by position: check its names and
positions against torch's own ``rebuild_cuda_tensor`` (CPU only, no CUDA needed)."""

import ast
import inspect
import textwrap

import pytest
from torch.multiprocessing import reductions

from ray_disagg.transport import cuda_ipc


def test_parameters_match_rebuild_cuda_tensor_signature():
    params = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert params == list(cuda_ipc._PARAMS)
    assert params.index("storage_device") == cuda_ipc._DEVICE_ARG
    assert cuda_ipc._PARAMS[cuda_ipc._DEVICE_ARG] == "storage_device"


def test_shared_cuda_arguments_match_torchs_own_call():
    """The tier calls ``UntypedStorage._new_shared_cuda`` with the arguments, in the order,
    that ``rebuild_cuda_tensor`` passes (read from torch's source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(reductions.rebuild_cuda_tensor)))
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "_new_shared_cuda"
    ]
    assert len(calls) == 1
    assert [a.id for a in calls[0].args] == list(cuda_ipc._SHARED_CUDA_ARGS)
    assert set(cuda_ipc._SHARED_CUDA_ARGS) <= set(cuda_ipc._PARAMS)


def test_named_args_refuses_another_layout():
    args = tuple(range(len(cuda_ipc._PARAMS)))
    assert cuda_ipc.named_args(args)["storage_device"] == cuda_ipc._DEVICE_ARG
    with pytest.raises(RuntimeError, match="not supported by the cuda_ipc tier"):
        cuda_ipc.named_args(args[:-1])
