"""Streamed generations as vLLM sends them: server-sent events of one token each, or of
several when the server is set to coalesce them (``tokens_per_event``), as vLLM does
under load.

Both generation routes stream the same way and differ only in their events' bodies
(an `EventBody` builds one). Events are encoded with ``asyncsync._core.encoding`` (like
vLLM's own streaming encoder, not the ``json.dumps`` of plain answers), which fixes
their bytes: keep it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from asyncsync._core import encoding as _json
from asyncsync.testing._fake._sampling import Job, Sample

#: The body of one event: ``(choice index, the sample so far, start, stop, final)``;
#: the event carries tokens ``start:stop``, and ``final`` ends its choice.
EventBody = Callable[[int, Sample, int, int, bool], Any]

_DONE = b"data: [DONE]\n\n"


def sse_event(body: Any) -> bytes:
    return b"data: " + _json.dumps(body) + b"\n\n"


async def stream(
    request: web.Request, job: Job, event: EventBody, *, empty_final: bool = True
) -> web.StreamResponse:
    """Streams ``job``'s choices one after the other, then ``data: [DONE]``.

    A token is sent as soon as it exists, unless it ends the sample (max_tokens, a stop
    token): the last event of a choice carries its finish reason with its last tokens.
    An abort comes between two tokens, so it gets an event of its own (no tokens), as in
    vLLM 0.32; with ``empty_final=False`` it gets none, as vLLM < 0.32's generate route
    skips every event without token ids (the abort's finish reason with it: the stream
    just ends with ``[DONE]``).
    """
    response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for index in range(job.params.n):
        await _stream_choice(response, job, index, event, empty_final)
    await response.write(_DONE)
    return response


async def _stream_choice(
    response: web.StreamResponse, job: Job, index: int, event: EventBody, empty_final: bool
) -> None:
    sent = 0  # tokens of this choice sent so far
    events = 0  # events of this choice sent so far
    size = job.state._event_size
    params = job.params

    async def on_token(sample: Sample, pos: int) -> None:
        nonlocal sent, events
        if pos + 1 == params.max_tokens or params.stops(
            sample.token_ids[pos], job.state.eos_token_id
        ):
            return  # the sample's last token: it goes out with the finish reason
        if pos + 1 - sent >= size(events):  # tokens sent:pos+1 fill the next event
            await response.write(sse_event(event(index, sample, sent, pos + 1, False)))
            sent, events = pos + 1, events + 1

    done = await job.sample(index, on_token)
    if empty_final or len(done.token_ids) > sent:
        await response.write(sse_event(event(index, done, sent, len(done.token_ids), True)))
