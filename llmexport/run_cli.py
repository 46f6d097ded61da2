"""``llmexport-run``: talk to an exported folder in MNN's runtime before shipping it.

Parses flags, checks the folder (llmexport.mnn.export_check), drives a ChatSession
(llmexport.mnn.chat) and maps errors to one line and an exit code (docs/cli.md). With ``--prompt``
it answers once (the answer alone on stdout, the timings on stderr); without, it chats, reading
one message per line from stdin.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import click

from llmexport import __version__

if TYPE_CHECKING:  # heavy: imported only after parsing
    from llmexport.mnn.chat import ChatSession, TurnResult
    from llmexport.mnn.export_check import RunnableExport

EXIT_INTERNAL = 1
PROG = "llmexport-run"
COMMANDS = {"/reset": "forget the conversation (the runtime's KV cache) and start over",
            "/exit": "quit (also /quit, end of input, Ctrl-C)", "/help": "this list"}


@dataclass(frozen=True)
class RunCommand:
    """The command line as click parsed it, one field per parameter of ``main`` under the same name
    (the flags, their defaults and help live in ``main``'s decorators only)."""

    export_dir: str
    prompt: str | None
    images: tuple[str, ...]
    audios: tuple[str, ...]
    max_new_tokens: int | None
    system: str | None
    raw: bool
    thread_num: int | None
    transcript: str | None
    quiet: bool


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("export_dir", type=click.Path(path_type=str))
@click.option("--prompt", default=None, help="Answer this one message and exit (answer on stdout, timings on stderr).")
@click.option("--image", "images", multiple=True, metavar="FILE",
              help="An image (JPEG, PNG, BMP) for the prompt or the first chat message; needs a vision tower.")
@click.option("--audio", "audios", multiple=True, metavar="FILE",
              help="A WAV file for the prompt or the first chat message; needs an audio tower.")
@click.option("--max_new_tokens", type=click.IntRange(min=1), default=None,
              help="Most tokens per answer (default: config.json's max_new_tokens, else 512).")
@click.option("--system", default=None, help="A system message in front of the conversation.")
@click.option("--raw", is_flag=True, help="Feed the text as it is, without the export's chat template.")
@click.option("--thread_num", type=click.IntRange(min=1), default=None,
              help="Runtime threads (default: config.json's).")
@click.option("--transcript", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Append each turn (text, ids, the KV cache's ids, timings) to this file as JSON lines.")
@click.option("--quiet", is_flag=True, help="No banner and no timings.")
@click.version_option(__version__, "--version", prog_name=PROG)
def main(**flags: Any) -> None:
    """Run an exported folder in MNN's runtime: chat with it, or answer one --prompt (greedy decoding)."""
    command = RunCommand(**flags)
    from llmexport.errors import LlmExportError

    for stream in (sys.stdout, sys.stderr):  # an answer's text must not fail on a terminal's narrow encoding
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
    for signum in (signal.SIGTERM, signal.SIGHUP):  # leave through the finally blocks that stop the runtime
        signal.signal(signum, _raise_exit)
    try:
        code = _run(command)
    except LlmExportError as exc:
        click.echo(f"{PROG}: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo(f"\n{PROG}: interrupted", err=True)
        sys.exit(128 + signal.SIGINT)
    except BrokenPipeError:  # the reader of stdout went away (`| head`): stop as a SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)
    except _Signalled as exc:
        click.echo(f"\n{PROG}: stopped by {signal.Signals(exc.signum).name}", err=True)
        sys.exit(128 + exc.signum)
    except Exception as exc:  # an llmexport bug: one line
        click.echo(f"{PROG}: internal error: {type(exc).__name__}: {exc}", err=True)
        sys.exit(EXIT_INTERNAL)
    sys.exit(code)


class _Signalled(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_exit(signum, frame):
    raise _Signalled(signum)


def _run(command: RunCommand) -> int:
    from llmexport.mnn.chat import ChatSession
    from llmexport.mnn.export_check import check_export

    folder, quiet = Path(command.export_dir), command.quiet
    export = check_export(folder)
    media = _media(export, command.images, command.audios)
    if not command.raw and not export.has_template:
        from llmexport.errors import UsageError

        raise UsageError(f"{folder}: llm_config.json has no chat template (jinja.chat_template); use --raw")
    limit = command.max_new_tokens or export.max_new_tokens
    log = _open_transcript(command.transcript) if command.transcript else None
    try:
        if not quiet:
            context = f"context {export.context} tokens" if export.context else "no declared context"
            click.echo(f"loading {folder} ({export.model_type}, {context}) ...", err=True)
        session = ChatSession(export, system=command.system, template=not command.raw, thread_num=command.thread_num)
        try:
            if not quiet:
                click.echo(f"loaded in {session.load_s:.2f} s", err=True)
            if command.prompt is not None:
                _answer(session, media + command.prompt, limit, quiet, log, 1)
                return 0
            return _chat(session, media, limit, quiet, log)
        except BaseException:
            session.kill()
            raise
        finally:
            session.close()
    finally:
        if log:
            log.close()


def _open_transcript(path: str) -> IO[str]:
    from llmexport.errors import OutputError

    try:
        return open(path, "a", encoding="utf-8")
    except OSError as exc:
        raise OutputError(f"--transcript {path}: cannot write ({exc.strerror})") from None


def _media(export: RunnableExport, images: tuple[str, ...], audios: tuple[str, ...]) -> str:
    """The runtime's prompt tags for --image/--audio, each file checked (UsageError)."""
    from llmexport.mnn.export_check import check_media, media_tag, require_tower

    for kind, files in (("image", images), ("audio", audios)):
        if files:
            require_tower(export, kind)
    tags = "".join(media_tag("image", path) for path in images) + "".join(media_tag("audio", path) for path in audios)
    check_media(tags, export)
    return tags


def _answer(session: ChatSession, text: str, limit: int, quiet: bool, log: IO[str] | None, turn: int) -> TurnResult:
    from llmexport.mnn.export_check import check_media

    check_media(text, session.export)

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = session.ask(text, limit, on_text=show)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not quiet:
        stop = {"length": " | stopped at max_new_tokens", "context": " | stopped: the context is full"}
        click.echo(f"[{result.stats.summary(session.export.context)}{stop.get(result.stop, '')}]", err=True)
    if log:
        log.write(json.dumps({"turn": turn, "user": text, **result.to_json()}) + "\n")
        log.flush()
    return result


def _chat(session: ChatSession, media: str, limit: int, quiet: bool, log: IO[str] | None) -> int:
    from llmexport.errors import UsageError

    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    if not quiet:
        click.echo("type a message; /reset starts over, /exit quits, /help lists the commands", err=True)
    turn, pending = 0, media  # --image/--audio go with the first message that is answered
    while True:
        line = _read_line(interactive)
        if line is None:
            return 0
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/help":
            click.echo("\n".join(f"{name:8} {what}" for name, what in COMMANDS.items()), err=True)
            continue
        if command == "/reset":
            session.reset()
            if log:
                log.write(json.dumps({"reset": True}) + "\n")
            if not quiet:
                click.echo("[conversation reset]", err=True)
            continue
        if not command:
            continue
        try:
            _answer(session, pending + line, limit, quiet, log, turn + 1)
        except UsageError as exc:  # this message does not fit; the conversation goes on
            click.echo(f"{PROG}: error: {exc}", err=True)
            continue
        turn, pending = turn + 1, ""


def _read_line(interactive: bool) -> str | None:
    if interactive:
        try:
            return input("> ")
        except EOFError:
            return None
    line = sys.stdin.readline()
    return line.rstrip("\r\n") if line else None


if __name__ == "__main__":
    main()
