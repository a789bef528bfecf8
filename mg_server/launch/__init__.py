"""The main process: the `mg-server` command, start-up checks, the start of mg's processes and
SGLang (with the front attached), supervision and stop."""
