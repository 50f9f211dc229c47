"""The expression language of masks and score modifiers.

ir.py (nodes and constructors), parse.py (source and Python functions -> IR, through an
ast whitelist), derivative.py (for the backward), to_triton.py (IR -> Triton expression
text), to_torch.py (IR evaluated with PyTorch, for the reference).
"""
