"""``omni-runtime serve``: the HTTP server under uvicorn, with the runtime's shutdown (drain,
abort what is left, close the engine)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

from omni_runtime.logs import configure_logging

from .args import API_KEY_ENV, CliError, placement_args


def _local_url(host: str, port: int) -> str:
    """This server's own address as others reach it: the machine's name for a wildcard bind."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _make_server(config: Any, state: Any, shutdown_timeout: float) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn with the runtime's shutdown: drain, then abort what is left, then close the engine.

        1) the first SIGTERM/SIGINT stops accepting and lets in-flight requests finish
        2) after ``shutdown_timeout`` the rest are aborted (their clients get a 503 saying why)
        3) the engine is closed, so no stage process outlives the server
        A second signal skips the wait (in-flight requests are aborted at once), not step 3.
        """

        loop: asyncio.AbstractEventLoop | None = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn re-raises a captured signal after shutdown, which would end the process by
            # the signal's default action (exit status -15) after a clean shutdown; exit 0 instead.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                self.should_exit = True
                return
            self.force_exit = True
            if self.loop is not None:
                self.loop.call_soon_threadsafe(state.abort_all, "the server was stopped before the request finished")

        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            self.loop = asyncio.get_running_loop()
            # A dead engine cannot come back: drain (its requests have all failed) and exit.
            state.on_dead.append(lambda error: setattr(self, "should_exit", True))
            await super().serve(sockets)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = sockets[0].getsockname()[:2] if sockets else (config.host, config.port)
                logging.getLogger("uvicorn.error").info(
                    "Serving %s on http://%s:%d", ", ".join(state.multi.names), host, port
                )

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            state.draining = True  # new requests on open connections get a 503
            reason = f"the server shut down; the request did not finish within the {shutdown_timeout:g} s grace period"
            timer = asyncio.get_running_loop().call_later(shutdown_timeout, state.abort_all, reason)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()
                await state.close()  # first: a forced exit skips the lifespan shutdown below
                if self.force_exit:
                    await self.lifespan.shutdown()  # ends the app's lifespan task instead of cancelling it

    return Server(config)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    # lazy: imports FastAPI and the engine (not at the CLI's start)
    from ..multi_omni import load_models_file, parse_model_arg
    from ..openai.job_manager import JobSettings
    from ..openai.realtime_session import RealtimeLimits
    from ..openai.server import create_app
    from ..openai.timeouts import timed_protocol

    # Before the app imports anything: the runtime's lines at --log-level, the libraries' warnings
    # only at debug; the stage processes get the same level.
    configure_logging(args.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = _server_api_key(args)
    models = [parse_model_arg(m) for m in args.model] + (load_models_file(args.models_file) if args.models_file else [])
    app = create_app(
        models or "tiny-sd",
        api_key=api_key,
        max_pending=args.max_pending,
        default_timeout=args.default_timeout,
        max_loaded_models=args.max_loaded_models,
        max_resident_bytes=args.max_resident_bytes,
        load_timeout=args.load_timeout,
        engine_args={
            "max_num_seqs": args.max_num_seqs,
            "request_batch_max_wait_ms": args.request_batch_max_wait_ms,
            "step_execution": args.step_execution,
            **placement_args(args),
        },
        ray_address=args.ray_address,
        allowed_origins=args.allowed_origins,
        file_ttl_s=args.file_ttl,
        file_store_bytes=int(args.file_store_mb * 1024 * 1024),
        jobs=JobSettings(
            redis_url=args.redis_url,
            ttl_s=args.job_ttl,
            max_jobs=args.max_jobs,
            lease_s=args.job_lease,
            otlp_endpoint=args.otlp_endpoint,
            max_streams=args.job_streams,
            redis_connections=args.redis_connections,
            redis_timeout_s=args.redis_timeout,
        ),
        public_url=args.public_url,
        local_url=_local_url(args.host, args.port),
        realtime=RealtimeLimits(max_sessions=args.realtime_sessions, idle_timeout_s=args.realtime_idle_timeout),
    )
    # Bind before the engine starts: a busy port is a clear error, not a model load and a crash.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        lifespan="on",
        # A backstop only: requests still running at shutdown_timeout are aborted by the server.
        timeout_graceful_shutdown=args.shutdown_timeout + 10.0,
        # Slow clients (trickled headers, stalled bodies) are cut off; see openai/timeouts.py.
        http=timed_protocol(args.header_timeout, args.body_timeout),
    )
    state = app.state.omni
    server = _make_server(config, state, args.shutdown_timeout)
    try:
        server.run(sockets=[sock])
    except SystemExit as e:  # uvicorn exits this way when the app fails to start
        if e.code:
            raise CliError("the server failed to start (see the log above)") from None
    finally:
        sock.close()
        state.multi.close()
    if state.dead is not None:
        # Non-zero, so that a supervisor (systemd, Kubernetes) starts a fresh server.
        raise CliError(f"the engine died, so the server stopped: {state.dead}")
    if state.failed is not None:
        raise CliError(f"the engine failed to start, so the server stopped: {state.failed}")
    return 0


def _server_api_key(args: argparse.Namespace) -> str | None:
    """The key ``serve`` requires: from ``--api-key``, ``--api-key-file`` or ``$OMNI_RUNTIME_API_KEY``
    (the last two keep it out of ``ps``), at most one of them; none: no key required."""
    sources: dict[str, str] = {}
    if args.api_key is not None:
        sources["--api-key"] = args.api_key
    if args.api_key_file is not None:
        try:
            sources["--api-key-file"] = args.api_key_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"--api-key-file: cannot read {args.api_key_file}: {e}") from None
    if os.environ.get(API_KEY_ENV):
        sources[f"${API_KEY_ENV}"] = os.environ[API_KEY_ENV]
    if len(sources) > 1:
        raise CliError(f"the API key is given twice ({' and '.join(sources)}); give it one way")
    if not sources:
        return None
    ((where, key),) = sources.items()
    if not key:
        raise CliError(f"{where}: the API key is empty")
    logging.getLogger(__name__).info("requiring an API key on /v1 routes (from %s)", where)
    return key
