"""The `flashgen` command's entry point (pyproject's [project.scripts]). It imports flashgen's CLI inside main(), so
that a Ctrl-C during that import ends the command as one during its work does: "interrupted" on stderr and exit
status 130, not Python's traceback of the import. A module of its own beside the package: any module inside
flashgen imports the package first, before its own code runs. (The CLI's import is a fraction of a second since
torch and Triton load on a command's first use of a kernel, inside the command, where the CLI catches a Ctrl-C;
`python -m flashgen` imports the package outside main(), where one still prints Python's traceback.)"""

import sys

EXIT_INTERRUPTED = 130  # flashgen.cli's EXIT_INTERRUPTED, which cannot be imported here: the shell's code for Ctrl-C


def main():
    try:
        from flashgen.cli import main as cli_main
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return EXIT_INTERRUPTED
    return cli_main()
