"""The one compiled part of wsched: the eager call's native launch path (codegen/native_launch.c,
plain C against Python's API only). Everything else is configured in pyproject.toml. The
extension is optional: where no C compiler is found the install goes on, and calls launch
through the Python path (codegen/native.py says which is in use)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("wsched.codegen._native_launch", ["codegen/native_launch.c"],
                             extra_compile_args=["-O2", "-std=c11", "-Wall"], optional=True)])
