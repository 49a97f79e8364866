"""Interactive explorations of the roofline: the roofline explorer, the GEMM workbench, the
fusion bench and the IO bounds of tiled attention and chunked losses.
"""
