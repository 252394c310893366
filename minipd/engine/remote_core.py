"""The engine-core protocol over a :class:`~minipd.engine.core_client.CoreClient`: one front end for a core
running in a thread or another process, as for one in this process."""

from __future__ import annotations

import os
import time
from typing import Any

from minipd.engine.core_client import CoreClient
from minipd.engine.core_messages import CoreError, ExportedKV
from minipd.engine.request import EngineCoreOutput, EngineCoreOutputs, FinishReason, Request
from minipd.engine.step_core import check_fits_pool
from minipd.kv.paged_pool import PackedKV


class RemoteCore:
    """The engine-core protocol (:class:`~minipd.engine.front_end.CoreProtocol`) over a :class:`CoreClient`, so
    the shared :class:`~minipd.engine.front_end.FrontEnd` drives a core running in a thread or another process
    as it drives one in this process.

    Two differences follow from the queue between them: an abort's final output comes back with a later
    :meth:`step` (not from :meth:`abort_requests` itself), and a request the core refused comes back as an
    ``"abort"`` output whose stop reason is the core's error.
    """

    def __init__(self, client: CoreClient, max_model_len: int, block_size: int, num_kv_blocks: int,
                 step_timeout: float = 0.05) -> None:
        self.client = client
        self.max_model_len, self.block_size, self.num_kv_blocks = max_model_len, block_size, num_kv_blocks
        self.step_timeout = step_timeout
        #: Live requests, by id (until their final output comes back).
        self.requests: dict[str, Request] = {}
        #: K/V the core sent back for ``export_kv``, by request id.
        self.exported: dict[str, PackedKV] = {}
        self.num_steps = 0
        self._failure: Exception | None = None

    @classmethod
    def in_process(cls, model: str | os.PathLike, start_timeout: float = 120.0, **llm_options: Any) -> RemoteCore:
        """A core in a spawned process (see :meth:`CoreClient.in_process`), behind this protocol."""
        client = CoreClient.in_process(model, start_timeout, **llm_options)
        info = client.info
        return cls(client, info.max_model_len, int(info.kv_spec["block_size"]), info.num_kv_blocks)

    def check_fits(self, num_tokens: int, max_tokens: int, what: str = "the request") -> None:
        """Refuse a request that could never fit the core's pool, however long it waited."""
        check_fits_pool(num_tokens, max_tokens, self.max_model_len, self.block_size, self.num_kv_blocks, what)

    def add_request(self, request: Request, kv: PackedKV | None = None) -> None:
        """Send ``request`` to the core."""
        self.client.add_request(request, kv)
        self.requests[request.request_id] = request

    def abort_requests(self, request_ids: Any, reason: FinishReason = FinishReason.ABORT) -> list:
        """Ask the core to end these requests; their final outputs come with a later :meth:`step`."""
        live = [r for r in request_ids if r in self.requests]
        if live:
            self.client.abort_requests(live, reason)
        return []

    def step(self) -> EngineCoreOutputs:
        """Every output the core sent (waiting up to ``step_timeout`` for the first)."""
        outputs: list[EngineCoreOutput] = []
        wait = self.step_timeout
        while True:
            try:
                message = self.client.get_output(timeout=wait)
            except TimeoutError:
                break
            wait = 0.0
            if isinstance(message, EngineCoreOutputs):
                self.num_steps += 1
                outputs.extend(message.outputs)
            elif isinstance(message, ExportedKV):
                self.exported[message.request_id] = message.kv
            elif isinstance(message, CoreError) and message.request_id in self.requests:
                outputs.append(EngineCoreOutput(message.request_id, [], FinishReason.ABORT, message.message))
            elif isinstance(message, CoreError) and self._failure is None:
                self._failure = RuntimeError(message.message)
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return EngineCoreOutputs(outputs, time.perf_counter())

    def take_failure(self) -> Exception | None:
        """An error the core reported that was about no request (a step that failed and was rolled back)."""
        failure, self._failure = self._failure, None
        return failure

    def has_unfinished_requests(self) -> bool:
        """True until every request's final output came back."""
        return bool(self.requests)

    def shutdown(self) -> None:
        """Stop the core (see :meth:`CoreClient.shutdown`)."""
        self.client.shutdown()


__all__ = ["RemoteCore"]
