"""The torch model layer: a Llama-family decoder over a flattened, paged batch, and its loader.

Import the submodules (`engine.model.llama`, `engine.model.loader`); this package stays light.
"""
