// A js-libp2p peer for primenode's interop tests (tests/interop/), driven over stdin/stdout.
//
// Why: every other test runs primenode against primenode, i.e. py-libp2p against itself;
// this is an independent implementation of the same specs (TCP, multistream-select, Noise,
// yamux, identify, ping, circuit relay v2), so a test here fails when we drift from the
// specs, not only when we disagree with ourselves.
//
// Protocol: one JSON object per line in, one per line out. A request carries "id" and "op";
// the answer echoes "id" with "ok": true and the op's fields, or "ok": false and "error".
// One process holds any number of named libp2p nodes (starting Node costs ~0.5 s, a node
// a few ms), so a test module starts this once.
//
// Ops:
//   create   {name, security: "noise" | "plaintext" | "spoof", claim?, relay_server?, listen?,
//            seed_hex?} -> {peer_id, addrs}. "spoof": plaintext that presents `claim`'s public
//            key, i.e. claims another peer's id without holding its key (the attack of issue 30).
//            `seed_hex`: the node's ed25519 key from this 32-byte seed (the test signs
//            primenode envelopes with the same key, so they are this node's own messages).
//   addrs    {name, contains?, timeout_ms?} -> {addrs}, waiting until one contains `contains`.
//   dial     {name, addr} -> {peer, remote_addr, limited}
//   ping     {name, peer? | addr?} -> {rtt_ms}
//   identify {name, peer, relayed?, timeout_ms?} -> the identify result this node got from
//            `peer` (on a relayed connection if `relayed`), waiting for it.
//   request  {name, addr? | peer?, protocol, data_hex, timeout_ms?} -> {response_hex}: open a
//            stream, write the bytes, close our side, read to the end.
//   send     {name, addr? | peer?, protocol, data_hex, timeout_ms?} -> {}: open a stream, write
//            the bytes, close our side (a gossip frame pushed at a node, expecting no answer).
//   cycle    {name, addr, n} -> {ok, failed, errors}: dial `addr` and hang up, `n` times in a row.
//   hold     {name, addr, protocol, n} -> {opened, refused, errors}: open `n` streams of
//            `protocol` at once and write nothing on them (a peer that holds its allowance).
//   release  {name} -> {closed}: abort the streams `hold` opened.
//   conns    {name} -> {conns: [{peer, remote_addr, limited}]}
//   hangup   {name, peer}
//   stop     {name}
import './polyfill.mjs'

import { createInterface } from 'node:readline'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { circuitRelayServer, circuitRelayTransport } from '@libp2p/circuit-relay-v2'
import { identify } from '@libp2p/identify'
import { peerIdFromString } from '@libp2p/peer-id'
import { generateKeyPairFromSeed } from '@libp2p/crypto/keys'
import { ping } from '@libp2p/ping'
import { plaintext } from '@libp2p/plaintext'
import { tcp } from '@libp2p/tcp'
import { multiaddr } from '@multiformats/multiaddr'
import { createLibp2p } from 'libp2p'

const nodes = new Map() // name -> { node, identified: [{peer, relayed, result}] }

function out (obj) {
  process.stdout.write(JSON.stringify(obj) + '\n')
}

function isRelayed (conn) {
  return conn.remoteAddr.toString().includes('/p2p-circuit')
}

function sleep (ms) {
  return new Promise(resolve => setTimeout(resolve, ms))
}

async function waitFor (pred, timeoutMs, what) {
  const end = Date.now() + timeoutMs
  for (;;) {
    const v = pred()
    if (v) return v
    if (Date.now() > end) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`)
    await sleep(20)
  }
}

// Plaintext that presents someone else's public key: @libp2p/plaintext reads only
// `privateKey.publicKey` and `logger` from its components, so we hand it the claimed key.
function spoofedPlaintext (claimedPeerId) {
  const publicKey = peerIdFromString(claimedPeerId).publicKey
  if (publicKey == null) throw new Error(`cannot take a public key from ${claimedPeerId}`)
  return (components) => plaintext()({ logger: components.logger, privateKey: { publicKey } })
}

function node (name) {
  const entry = nodes.get(name)
  if (entry == null) throw new Error(`no node named ${name}`)
  return entry
}

function target (msg) {
  if (msg.addr != null) return multiaddr(msg.addr)
  return peerIdFromString(msg.peer)
}

const ops = {
  async create (msg) {
    if (nodes.has(msg.name)) throw new Error(`node ${msg.name} exists`)
    let encrypters
    if (msg.security === 'plaintext') encrypters = [plaintext()]
    else if (msg.security === 'spoof') encrypters = [spoofedPlaintext(msg.claim)]
    else encrypters = [noise()]
    const services = {
      identify: identify(),
      ping: ping({ runOnLimitedConnection: true })
    }
    if (msg.relay_server) {
      services.relay = circuitRelayServer()
    }
    const privateKey = msg.seed_hex == null
      ? undefined
      : await generateKeyPairFromSeed('Ed25519', Buffer.from(msg.seed_hex, 'hex'))
    const node = await createLibp2p({
      privateKey,
      addresses: { listen: msg.listen ?? ['/ip4/127.0.0.1/tcp/0'] },
      transports: [tcp(), circuitRelayTransport()],
      connectionEncrypters: encrypters,
      streamMuxers: [yamux()],
      services
    })
    const entry = { node, identified: [] }
    node.addEventListener('peer:identify', (evt) => {
      const r = evt.detail
      entry.identified.push({
        peer: r.peerId.toString(),
        relayed: isRelayed(r.connection),
        result: {
          protocols: r.protocols,
          listen_addrs: r.listenAddrs.map(a => a.toString()),
          observed_addr: r.observedAddr?.toString() ?? null,
          agent_version: r.agentVersion ?? null,
          protocol_version: r.protocolVersion ?? null,
          relayed: isRelayed(r.connection)
        }
      })
    })
    nodes.set(msg.name, entry)
    return { peer_id: node.peerId.toString(), addrs: node.getMultiaddrs().map(a => a.toString()) }
  },

  async addrs (msg) {
    const { node } = nodeOf(msg)
    const want = msg.contains
    const addrs = await waitFor(() => {
      const all = node.getMultiaddrs().map(a => a.toString())
      return (want == null || all.some(a => a.includes(want))) ? all : null
    }, msg.timeout_ms ?? 10000, `an address containing ${want}`)
    return { addrs }
  },

  async dial (msg) {
    const { node } = nodeOf(msg)
    const conn = await node.dial(multiaddr(msg.addr), { signal: AbortSignal.timeout(msg.timeout_ms ?? 10000) })
    return { peer: conn.remotePeer.toString(), remote_addr: conn.remoteAddr.toString(), limited: conn.limits != null }
  },

  async ping (msg) {
    const { node } = nodeOf(msg)
    const rtt = await node.services.ping.ping(target(msg), {
      runOnLimitedConnection: true,
      signal: AbortSignal.timeout(msg.timeout_ms ?? 10000)
    })
    return { rtt_ms: rtt }
  },

  async identify (msg) {
    const entry = nodeOf(msg)
    const hit = await waitFor(
      () => entry.identified.findLast(i => i.peer === msg.peer && (msg.relayed == null || i.relayed === msg.relayed)),
      msg.timeout_ms ?? 10000,
      `identify from ${msg.peer}${msg.relayed ? ' over a relayed connection' : ''}`
    )
    return hit.result
  },

  async request (msg) {
    const { node } = nodeOf(msg)
    const signal = AbortSignal.timeout(msg.timeout_ms ?? 10000)
    const stream = await node.dialProtocol(target(msg), msg.protocol, { signal, runOnLimitedConnection: true })
    stream.send(Buffer.from(msg.data_hex, 'hex'))
    await stream.close({ signal })
    const chunks = []
    for await (const chunk of stream) {
      chunks.push(Buffer.from(chunk.subarray()))
    }
    return { response_hex: Buffer.concat(chunks).toString('hex') }
  },

  async send (msg) {
    const { node } = nodeOf(msg)
    const signal = AbortSignal.timeout(msg.timeout_ms ?? 10000)
    const stream = await node.dialProtocol(target(msg), msg.protocol, { signal, runOnLimitedConnection: true })
    stream.send(Buffer.from(msg.data_hex, 'hex'))
    await stream.close({ signal })
    return {}
  },

  async cycle (msg) {
    const { node } = nodeOf(msg)
    let ok = 0
    let failed = 0
    const errors = []
    for (let i = 0; i < msg.n; i++) {
      try {
        const conn = await node.dial(multiaddr(msg.addr), { signal: AbortSignal.timeout(msg.timeout_ms ?? 10000) })
        await node.hangUp(conn.remotePeer)
        ok++
      } catch (err) {
        failed++
        if (errors.length < 5) errors.push(`${err.name}: ${err.message}`)
      }
    }
    return { ok, failed, errors }
  },

  async hold (msg) {
    const entry = nodeOf(msg)
    entry.held = entry.held ?? []
    const signal = AbortSignal.timeout(msg.timeout_ms ?? 10000)
    const results = await Promise.allSettled(Array.from({ length: msg.n }, () =>
      entry.node.dialProtocol(multiaddr(msg.addr), msg.protocol, { signal })))
    const errors = []
    let opened = 0
    for (const r of results) {
      if (r.status === 'fulfilled') {
        entry.held.push(r.value)
        opened++
      } else if (errors.length < 5) {
        errors.push(`${r.reason.name}: ${r.reason.message}`)
      }
    }
    return { opened, refused: msg.n - opened, errors }
  },

  async release (msg) {
    const entry = nodeOf(msg)
    const held = entry.held ?? []
    entry.held = []
    for (const s of held) s.abort(new Error('released'))
    return { closed: held.length }
  },

  async conns (msg) {
    const { node } = nodeOf(msg)
    return {
      conns: node.getConnections().map(c => ({
        peer: c.remotePeer.toString(), remote_addr: c.remoteAddr.toString(), limited: c.limits != null
      }))
    }
  },

  async hangup (msg) {
    const { node } = nodeOf(msg)
    await node.hangUp(peerIdFromString(msg.peer))
    return {}
  },

  async stop (msg) {
    const { node } = nodeOf(msg)
    nodes.delete(msg.name)
    await node.stop()
    return {}
  }
}

function nodeOf (msg) {
  return node(msg.name)
}

async function handle (line) {
  let msg
  try {
    msg = JSON.parse(line)
  } catch (err) {
    out({ id: null, ok: false, error: `bad json: ${err.message}` })
    return
  }
  const op = ops[msg.op]
  if (op == null) {
    out({ id: msg.id, ok: false, error: `unknown op ${msg.op}` })
    return
  }
  try {
    out({ id: msg.id, ok: true, ...(await op(msg)) })
  } catch (err) {
    out({ id: msg.id, ok: false, error: `${err.name}: ${err.message}` })
  }
}

// Requests run concurrently (a test may wait on one node while driving another).
const rl = createInterface({ input: process.stdin })
rl.on('line', (line) => { handle(line) })
rl.on('close', async () => {
  await Promise.allSettled([...nodes.values()].map(e => e.node.stop()))
  process.exit(0)
})
out({ id: 0, ok: true, ready: true, node_version: process.version })
