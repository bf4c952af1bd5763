"""A second fake backend (same behaviour as xfw_fake), so a compare has two sides."""
import runpy

runpy.run_module("xfw_fake", run_name="__main__")
