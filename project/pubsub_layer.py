"""channels_redis's pub/sub layer (project/channel_layer.py says why that layer) without its
ten wake-ups a second.

channels_redis's receiver reads its subscription connection in reads of 0.1 s each, and
sleeps 0.1 s at a time while nothing is subscribed: a daphne with nothing to deliver woke
ten times a second, each a read with its timeout set and cancelled, about three quarters
of an idle daphne's CPU (docs/live-page.md, "What it costs"). Here one read waits up to
:data:`RECEIVE_WAIT` seconds: a message ends it at once, so no message waits longer than
before; and a receiver with nothing subscribed waits for the next subscription instead of
looking every 0.1 s. Everything else — what is subscribed, sent and delivered, the
reconnection — is channels_redis's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from channels_redis import pubsub

logger = logging.getLogger(__name__)

#: Seconds one read of the subscription connection waits for a message (channels_redis's
#: own: 0.1). A message ends the wait at once; this is only how often an idle daphne wakes.
RECEIVE_WAIT = 5.0


class QuietShardConnection(pubsub.RedisSingleShardConnection):
    """One Redis host's connection of the layer, read in long waits (:data:`RECEIVE_WAIT`)."""

    def __init__(self, host, channel_layer) -> None:
        super().__init__(host, channel_layer)
        self._subscribed_now = asyncio.Event()

    async def subscribe(self, channel) -> None:
        await super().subscribe(channel)
        self._subscribed_now.set()

    async def _do_receiving(self) -> None:
        while True:
            try:
                if self._pubsub and self._pubsub.subscribed:
                    message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=RECEIVE_WAIT)
                    self._receive_message(message)
                else:
                    # Cleared and waited with no await between the check above and here, so a
                    # subscription made meanwhile is never missed.
                    self._subscribed_now.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._subscribed_now.wait(), RECEIVE_WAIT)
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except BaseException:  # as channels_redis: logged, tried again a second later
                logger.exception("Unexpected exception in receive task")
                await asyncio.sleep(1)


class QuietLoopLayer(pubsub.RedisPubSubLoopLayer):
    """channels_redis's per-event-loop layer, its shards read by :class:`QuietShardConnection`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._shards = [QuietShardConnection(shard.host, self) for shard in self._shards]  # type: ignore[has-type]


class QuietPubSubChannelLayer(pubsub.RedisPubSubChannelLayer):
    """The ``CHANNEL_LAYERS`` backend (project/settings.py): channels_redis's
    ``RedisPubSubChannelLayer`` whose per-loop layers are :class:`QuietLoopLayer`."""

    def _get_layer(self):
        loop = asyncio.get_running_loop()
        try:
            return self._layers[loop]
        except KeyError:
            layer = self._layers[loop] = QuietLoopLayer(*self._args, **self._kwargs, channel_layer=self)
            pubsub._wrap_close(self, loop)
            return layer
