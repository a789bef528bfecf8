"""Diagnostic for benchmarks only: run a function on a module right after its first import (the
profiling hooks of this folder patch mg's and SGLang's functions that way)."""

import importlib.abc
import importlib.util
import sys


def after_import(hooks: dict) -> None:
    """hooks: module name -> fn(module), each called once, after that module has executed."""

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            fn = hooks.pop(name, None)
            if fn is None:
                return None
            sys.meta_path.remove(self)  # find the real spec without recursing into this finder
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            run = spec.loader.exec_module

            def exec_module(m):
                run(m)
                fn(m)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())
