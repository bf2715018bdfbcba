from .rms_norm import add_rms_norm, rms_norm
from .rope import rope
from .swiglu import swiglu
