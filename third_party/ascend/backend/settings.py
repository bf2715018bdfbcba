"""The ascend backend's own settings, declared as tritonspec declares its (``tritonspec.settings``).

Imported on use, never during Triton's backend discovery (with the layer disabled, discovery must
import no tritonspec module).
"""

from tritonspec.settings import env_str

from .compiler import DEFAULT_ARCH

ARCH = env_str("TRITONSPEC_ASCEND_ARCH", DEFAULT_ARCH, "the SoC the target names (GPUTarget's arch)")
COMPILE_FLAGS = env_str(
    "TRITONSPEC_ASCEND_COMPILE_FLAGS", None, "extra arguments for bishengir-compile, split as a shell would"
)
