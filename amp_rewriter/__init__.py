"""amp-rewriter: automatic mixed precision for ONNX and TensorFlow graphs.

`convert` / `convert_file` take either format (`convert_auto` and `diagnose` measure on
calibration data); `amp_rewriter.tf` holds the TensorFlow-only entry
points (training graphs, SavedModels). Importing this package imports neither onnx nor
tensorflow: each format's library is imported when that format is used.
"""

from .api import convert, convert_auto, convert_file, diagnose
from .errors import AmpError, CheckFailed
from .options import AutoOptions, OnnxOptions, Options, TfOptions, TrainingOptions
from .report import Report
from .version import package_version

__all__ = ["convert", "convert_auto", "convert_file", "diagnose", "AmpError", "CheckFailed",
           "Options", "OnnxOptions", "TfOptions", "TrainingOptions", "AutoOptions", "Report"]
__version__ = package_version()
