"""What this machine is: library and driver versions, and the CUDA device or why there is none.
No device is needed for any of it."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess

from ..errors import one_line
from .checks import describe


def collect_versions() -> dict:
    """Python, torch, the CUDA runtime torch was built for, cuDNN, NCCL and the driver."""
    import torch
    import torch.distributed as dist
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "cuda_runtime": torch.version.cuda, "cudnn": None, "nccl": None,
         "nccl_available": bool(dist.is_available() and dist.is_nccl_available())}
    try:
        code = torch.backends.cudnn.version()
        v["cudnn"] = cudnn_version(code) if code else None
    except Exception as e:   # a cuDNN that cannot be loaded is worth saying
        v["cudnn_error"] = describe(e)
    try:
        nccl = torch.cuda.nccl.version()
        v["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception:        # CPU builds have no NCCL: nccl stays None
        pass
    v["driver"], v["driver_source"] = driver_version()
    return v


def cudnn_version(code: int) -> str:
    """torch.backends.cudnn.version()'s integer as major.minor.patch."""
    # cuDNN 9 encodes major*10000 + minor*100 + patch, cuDNN 8 and older major*1000 + ...
    major, rest = (code // 10000, code % 10000) if code >= 90000 else (code // 1000, code % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def driver_version() -> tuple:
    """(version, where it came from). nvidia-smi gives the driver's own version (550.54.15);
    without it torch only knows the CUDA version the driver supports (12.4)."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            r = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            if r.returncode == 0 and r.stdout.split():
                return r.stdout.split()[0], "nvidia-smi"
        except (OSError, subprocess.SubprocessError):
            pass
    import torch
    get = getattr(torch._C, "_cuda_getDriverVersion", None)   # CUDA builds only
    if get is not None:
        try:
            code = get()
            if code:
                return (f"supports CUDA {code // 1000}.{code % 1000 // 10}",
                        "torch (no nvidia-smi)")
        except Exception:
            pass
    return None, None


def device_info() -> dict:
    """The CUDA device this process would train on, or why there is none."""
    import torch
    if not torch.cuda.is_available():
        return {"cuda": False, "reason": _no_cuda_reason(torch)}
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {"cuda": True, "reason": None, "index": index, "count": torch.cuda.device_count(),
            "name": props.name, "capability": [props.major, props.minor],
            "memory_gib": props.total_memory / 2**30, "sm_count": props.multi_processor_count}


def _no_cuda_reason(torch) -> str:
    try:   # is_available() is silent; init() raises with the actual reason
        torch.cuda.init()
        why = "torch.cuda.is_available() is False"
    except Exception as e:
        why = one_line(e, limit=200)
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build ({why})"
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no GPU "
            f"({why}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
