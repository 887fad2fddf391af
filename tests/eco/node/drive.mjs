// Drives FenceMQ with Redis clients no one here wrote: node drive.mjs <scenario> <port>.
// Prints one JSON object (what the clients saw) for tests/eco to judge; exits 2 when a
// client never gets going (ioredis reconnects for ever when its ready check fails).
import Redis from 'ioredis';
import { createClient, createClientPool } from 'redis';

const [scenario, port] = [process.argv[2], Number(process.argv[3])];
setTimeout(() => { console.error(`${scenario}: no answer within 15 s`); process.exit(2); }, 15000).unref();

const toText = (v) => Buffer.isBuffer(v) ? v.toString() : Array.isArray(v) ? v.map(toText) : v;
// a map reply: a flat array in RESP2, a Map or an object in RESP3
const asMap = (m) => Array.isArray(m)
  ? Object.fromEntries(m.flatMap((v, i) => (i % 2 ? [] : [[toText(m[i]), toText(m[i + 1])]])))
  : m instanceof Map ? Object.fromEntries(m) : m;
const deliveries = (reply) => reply.map(asMap);

async function ioredisDefault() {
  // default options: the ready check sends INFO and waits for loading:0
  const r = new Redis({ port, maxRetriesPerRequest: 1, retryStrategy: () => null });
  await new Promise((ok, fail) => { r.once('ready', ok); r.once('error', fail); });
  const info = await r.info('server');
  const id = await r.call('PUB', 'orders', 'hello');
  const txn = await r.multi().call('PUB', 'orders', 'a').call('PUB', 'orders', 'b').exec();
  await r.quit();
  return { status: 'ready', info: info.split('\r\n')[1], id, txn };
}

async function ioredisPool() {
  // two connections of one client id share its session: SUB on one, PULL and ACK on the other
  const opts = { port, connectionName: 'io-app', maxRetriesPerRequest: 1, retryStrategy: () => null };
  const [a, b] = [new Redis(opts), new Redis(opts)];
  await Promise.all([a, b].map((r) => new Promise((ok) => r.once('ready', ok))));
  await a.call('PUB', 'jobs', 'j1');
  const sub = asMap(toText(await a.call('SUB', 'jobs', 'GROUP', 'workers')));
  const pulled = deliveries(toText(await b.call('PULL', sub.handle, 'COUNT', '10')));
  const acked = await a.call('ACK', sub.handle, pulled[0].tag);
  const names = [await a.client('GETNAME'), await b.client('GETNAME')];
  const transaction = await b.multi().call('PUB', 'jobs', 'j2').call('PULL', sub.handle, 'COUNT', '1').exec();
  const [[, , ], [, inTxn]] = transaction;
  await a.quit(); await b.quit();
  return { acked, names, payloads: pulled.map((d) => d.payload), txnPayload: deliveries(toText(inTxn))[0].payload };
}

async function nodeRedisClient() {
  const c = createClient({ socket: { port, reconnectStrategy: false }, name: 'nr-app' });
  c.on('error', () => {});
  await c.connect();
  const info = await c.info();
  await c.sendCommand(['PUB', 'news', 'n1']);
  const sub = asMap(await c.sendCommand(['SUB', 'news', 'GROUP', 'readers']));
  const results = await c.multi()
    .addCommand(['PUB', 'news', 'n2'])
    .addCommand(['PULL', sub.handle, 'COUNT', '10'])
    .exec();
  const got = deliveries(results[1]);
  const acked = await c.sendCommand(['ACK', sub.handle, ...got.map((d) => d.tag)]);
  let discarded = 'none';
  try {
    await c.multi().addCommand(['PUB', 'news', 'never']).addCommand(['NOSUCHVERB']).exec();
  } catch (err) { discarded = String(err.message || err); }
  const rest = await c.sendCommand(['PULL', sub.handle, 'COUNT', '10']);
  await c.quit();
  return { loading: /loading:0/.test(info), payloads: got.map((d) => d.payload), acked, discarded, rest };
}

async function nodeRedisPool() {
  const pool = createClientPool({ socket: { port, reconnectStrategy: false }, name: 'nr-pool' }, { minimum: 4, maximum: 4 });
  pool.on('error', () => {});
  await pool.connect();
  await pool.sendCommand(['MPUB', 'tasks', '8', 't1', 't2', 't3', 't4', 't5', 't6', 't7', 't8']);
  const sub = asMap(await pool.sendCommand(['SUB', 'tasks', 'GROUP', 'crew']));
  // eight consumers at once over the pool's four connections
  const got = await Promise.all(Array.from({ length: 8 }, async () => {
    const [d] = deliveries(await pool.sendCommand(['PULL', sub.handle]));
    return d ? [d.payload, await pool.sendCommand(['ACK', sub.handle, d.tag])] : ['none', 0];
  }));
  const ids = new Set(await Promise.all(Array.from({ length: 8 }, () => pool.execute((c) => c.sendCommand(['CLIENT', 'ID'])))));
  await pool.close();
  return { got: got.sort(), connections: ids.size };
}

const scenarios = { ioredisDefault, ioredisPool, nodeRedisClient, nodeRedisPool };
try {
  console.log(JSON.stringify(await scenarios[scenario]()));
  process.exit(0);
} catch (err) {
  console.log(JSON.stringify({ error: String(err && err.stack || err) }));
  process.exit(1);
}
