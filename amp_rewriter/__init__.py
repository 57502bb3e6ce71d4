"""amp-rewriter: automatic mixed precision for ONNX and TensorFlow graphs (TensorFlow entry points:
`amp_rewriter.tf_api`, which imports TensorFlow)."""

from .api import convert, convert_file
from .errors import AmpError, CheckFailed
from .report import Report

__all__ = ["convert", "convert_file", "AmpError", "CheckFailed", "Report"]
__version__ = "0.1.0"
