"""The only importer of llama_cpp. Loading this package first puts llama_cpp's own libggml files
in place by absolute path (libs.py), whatever LD_LIBRARY_PATH says, before any module here loads
libllama."""

from specrun.llama import libs as _libs

_libs.preload()
