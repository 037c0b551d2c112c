#!/usr/bin/env python3
"""A TCP proxy that adds a fixed latency to every HTTP request, as a remote object store would.

    latency_proxy.py LISTEN_PORT TARGET_HOST:TARGET_PORT DELAY_MS

Prints "ready PORT" once listening (port 0 picks a free one). Each request (the first bytes a
client sends after the previous response began) waits DELAY_MS before it is forwarded; the count
of delayed requests is written to stderr on SIGTERM, and to stdout ("requests N") on SIGUSR1. Standard library only (bench/ installs
nothing).
"""
import asyncio
import signal
import sys

requests = 0


async def pipe_client(reader, writer, state, delay):
    global requests
    while data := await reader.read(65536):
        if state["new"]:
            state["new"] = False
            requests += 1
            await asyncio.sleep(delay)
        writer.write(data)
        await writer.drain()
    writer.close()


async def pipe_server(reader, writer, state):
    while data := await reader.read(65536):
        state["new"] = True
        writer.write(data)
        await writer.drain()
    writer.close()


async def main():
    port, target, delay_ms = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    host, tport = target.rsplit(":", 1)

    async def handle(cr, cw):
        try:
            sr, sw = await asyncio.open_connection(host, int(tport))
        except OSError:
            cw.close()
            return
        state = {"new": True}
        try:
            await asyncio.gather(pipe_client(cr, sw, state, delay_ms / 1000), pipe_server(sr, cw, state))
        except (ConnectionError, OSError):
            pass
        finally:
            cw.close()
            sw.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, lambda: print(f"requests {requests}", flush=True))
    await stop.wait()
    print(f"requests {requests}", file=sys.stderr, flush=True)


asyncio.run(main())
