"""MTP speculative decoding: the speculator (mtp.py), draft trees and acceptance (tree.py), THE owner of the
out_cache_loc layouts (layout.py), and what the speculator uses of the model runner (runner_api.py: SpecRunner)."""
