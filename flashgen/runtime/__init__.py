"""What runs when a kernel is called: the host side of the rendered modules (host.py).

host.py is plain Python over torch and triton that imports nothing from flashgen, so that
`flashgen generate` can paste it verbatim into a standalone module.
"""
