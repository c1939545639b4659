#!/usr/bin/env python3
"""An origin on 127.0.0.1:18191 that answers every request after SLOW
seconds (default 6) with 1 KiB, `cache-control: max-age=600`: the slow
upstream of benches/support/burst_proxy.sh and h2_flight.sh."""
import asyncio, os
SLOW = float(os.environ.get("SLOW", "6"))
async def handle(r, w):
    try:
        while True:
            await r.readuntil(b"\r\n\r\n")
            await asyncio.sleep(SLOW)
            w.write(b"HTTP/1.1 200 OK\r\ncache-control: max-age=600\r\ncontent-length: 1024\r\n\r\n" + b"x" * 1024)
            await w.drain()
    except Exception:
        pass
    finally:
        w.close()
async def main():
    async with await asyncio.start_server(handle, "127.0.0.1", 18191, backlog=16384) as s:
        await s.serve_forever()
asyncio.run(main())
