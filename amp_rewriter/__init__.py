"""amp-rewriter: automatic mixed precision for ONNX and TensorFlow graphs.

`convert` / `convert_file` take either format; `amp_rewriter.tf` holds the TensorFlow-only entry
points (training graphs, SavedModels). Importing this package imports neither onnx nor
tensorflow: each format's library is imported when that format is used.
"""

from .api import convert, convert_file
from .errors import AmpError, CheckFailed
from .options import Options, TrainingOptions
from .report import Report

__all__ = ["convert", "convert_file", "AmpError", "CheckFailed", "Options", "TrainingOptions",
           "Report"]
__version__ = "0.1.0"
