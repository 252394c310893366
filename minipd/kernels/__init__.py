"""The engine's hot paths, each as a torch reference and (where written) a Triton kernel.

Every kernel here has the same signature in both backends; :mod:`minipd.kernels.backend` picks
one. The torch versions are the references the Triton ones are tested against, and they are also
what runs on CPU, so they are written to be fast there.
"""
