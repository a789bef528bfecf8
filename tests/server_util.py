"""The server-process helper of tests and benchmarks; it lives in the package
(`mg_server.evaluation.server_process`) because `mg-server calibrate` starts servers too."""

from mg_server.evaluation.server_process import ServerProcess, free_port  # noqa: F401
