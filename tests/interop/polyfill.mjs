// Promise.withResolvers (ES2024) is used by js-libp2p 3; Debian's Node 20 lacks it.
// Our own three lines, loaded before any libp2p module (peer.mjs imports this first).
if (typeof Promise.withResolvers !== 'function') {
  Promise.withResolvers = function withResolvers () {
    let resolve
    let reject
    const promise = new this((res, rej) => { resolve = res; reject = rej })
    return { promise, resolve, reject }
  }
}
