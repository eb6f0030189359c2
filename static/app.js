// Sonic media server: the browser side of one session.
// Sends the microphone over WebRTC, shows the returned avatar video with the delayed audio
// (one MediaStream, so the browser plays them in sync) and polls stats once a second.
// In viewer mode (/?session=ID&token=T) it only watches a session an application drives.
// All URLs are relative to the page, so it works on whatever host serves it.
'use strict';

const $ = (id) => document.getElementById(id);
const ui = {
  avatars: $('avatar-list'), upload: $('upload'), size: $('size'), chooser: $('chooser'),
  uploadError: $('upload-error'),
  start: $('start'), stop: $('stop'), video: $('video'), mute: $('mute'),
  muteLabel: $('mute-label'), muteHint: $('mute-hint'), tagline: $('tagline'),
  status: $('status'), error: $('error'), stats: $('stats'), knobs: $('knobs'),
  say: $('say'), sayText: $('say-text'), saySend: $('say-send'), events: $('events'),
};
const sliders = new Map(); // knob name -> its range input, built from GET /config

let pc = null;
let mic = null;
let channel = null; // a viewer's "events" data channel: the session's events, our messages
let sessionId = null;
let state = 'idle';
let avatarId = null;
let poster = ''; // the chosen (or watched) avatar's picture, shown while not playing
let statsTimer = null;
let previous = null; // last getStats() sample, for per-second deltas
let framesDecoded = 0;
let statsPoll = Promise.resolve(); // the stats refresh in flight, if any

// ---- helpers ------------------------------------------------------------------------

async function api(method, url, body, timeoutMs = 20000) {
  const init = { method, headers: {} };
  if (body instanceof FormData) {
    init.body = body;
  } else if (body !== undefined) {
    init.headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const response = await fetch(url, { ...init, signal: AbortSignal.timeout(timeoutMs) });
  if (response.status === 204) return null;
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    const message = data?.message ?? `${method} ${url} failed with HTTP ${response.status}`;
    const error = new Error(message);
    error.code = data?.error;
    error.status = response.status;
    error.retryAfter = Number(response.headers.get('Retry-After')) || null;
    throw error;
  }
  return data;
}

function setState(next, text) {
  state = next;
  ui.status.dataset.state = next;
  ui.status.textContent = text ?? next[0].toUpperCase() + next.slice(1);
}

// Errors show in view, next to what failed: the session's under Start and Stop, an
// upload's under the file input (``where``).
function showError(error, where = ui.error) {
  const message = error instanceof Error ? error.message : String(error);
  console.error(error);
  where.textContent = message;
  where.hidden = false;
}

function clearError() {
  for (const where of [ui.error, ui.uploadError]) {
    where.hidden = true;
    where.textContent = '';
  }
}

function showPoster(url) {
  poster = url;
  if (!ui.video.srcObject) ui.video.poster = poster;
}

function setRunning(running) {
  ui.start.disabled = running;
  ui.stop.disabled = !running;
  ui.chooser.disabled = running;
}

// ---- avatars ------------------------------------------------------------------------

function selectAvatar(id) {
  avatarId = id;
  for (const input of ui.avatars.querySelectorAll('input')) input.checked = input.value === id;
  showPoster(`avatars/${encodeURIComponent(id)}/image`);
}

// An upload is named after its file, often wider than a thumbnail: the name wraps, after
// "_" and "-" and before "." where it can (my_portrait | .jpg), so it is shown whole.
function wrappable(name) {
  const parts = [''];
  for (const ch of name) {
    if (ch === '.' && parts[parts.length - 1]) parts.push('');
    parts[parts.length - 1] += ch;
    if (ch === '_' || ch === '-') parts.push('');
  }
  return parts.filter(Boolean)
    .flatMap((part, i) => (i ? [document.createElement('wbr'), part] : [part]));
}

async function loadAvatars(select) {
  const { avatars, default: fallback } = await api('GET', 'avatars');
  ui.avatars.replaceChildren(...avatars.map((a) => {
    const label = document.createElement('label');
    label.className = 'avatar';
    label.title = a.credit ? `${a.name}: ${a.credit}` : a.name;
    const input = Object.assign(document.createElement('input'),
      { type: 'radio', name: 'avatar', value: a.avatar_id });
    input.addEventListener('change', () => selectAvatar(a.avatar_id));
    const img = Object.assign(document.createElement('img'),
      { src: `avatars/${encodeURIComponent(a.avatar_id)}/image`, alt: a.name, loading: 'lazy' });
    const name = document.createElement('span');
    name.append(...wrappable(a.name));
    label.append(input, img, name);
    return label;
  }));
  const ids = avatars.map((a) => a.avatar_id);
  const wanted = [select, avatarId, fallback].find((id) => id && ids.includes(id)) ?? ids[0];
  if (wanted) selectAvatar(wanted);
  ui.avatars.dataset.count = String(avatars.length);
}

async function uploadAvatar() {
  const file = ui.upload.files[0];
  if (!file) return;
  clearError();
  const form = new FormData();
  form.append('image', file, file.name);
  setState(state, `Uploading ${file.name}…`);
  try {
    const avatar = await api('POST', 'avatars', form);
    await loadAvatars(avatar.avatar_id);
    setState(state, `Added avatar “${avatar.name}”`);
  } catch (error) {
    setState(state, 'Upload failed');
    showError(`Upload failed: ${error.message}`, ui.uploadError);
  } finally {
    ui.upload.value = '';
  }
}

// ---- the session --------------------------------------------------------------------

function knobs() {
  return Object.fromEntries([...sliders].map(([name, input]) => [name, Number(input.value)]));
}

// One slider per knob the server defines (name, label, range, default, what it does), and
// the frame sizes it allows: the page hard-codes neither.
async function loadControls() {
  const { settings, knobs: defined } = await api('GET', 'config');
  ui.size.replaceChildren(...settings.video.allowed_sizes.map((size) => Object.assign(
    document.createElement('option'),
    { value: String(size), textContent: `${size} × ${size}`,
      selected: size === settings.video.size })));
  for (const knob of defined) {
    const id = knob.name.replaceAll('_', '-');
    const label = Object.assign(document.createElement('label'),
      { className: 'slider', htmlFor: id, title: `${knob.name}: ${knob.doc}` });
    const input = Object.assign(document.createElement('input'), {
      type: 'range', id, min: String(knob.min), max: String(knob.max),
      step: String((knob.max - knob.min) / 40), value: String(knob.default),
    });
    input.dataset.knob = knob.name;
    const output = Object.assign(document.createElement('output'),
      { id: `${id}-value`, textContent: Number(knob.default).toFixed(2) });
    output.htmlFor = id;
    label.append(Object.assign(document.createElement('span'), { textContent: knob.label }),
      input, output);
    input.addEventListener('input', () => onKnob(input));
    sliders.set(knob.name, input);
    ui.knobs.append(label);
  }
}

function iceGatheringComplete(peer, timeoutMs = 5000) {
  if (peer.iceGatheringState === 'complete') return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      if (peer.iceGatheringState !== 'complete') return;
      peer.removeEventListener('icegatheringstatechange', done);
      clearTimeout(timer);
      resolve();
    };
    // Without STUN servers gathering is quick; if it stalls, send what we have.
    const timer = setTimeout(() => {
      peer.removeEventListener('icegatheringstatechange', done);
      resolve();
    }, timeoutMs);
    peer.addEventListener('icegatheringstatechange', done);
  });
}

// Viewer mode: /?session=ID&token=T watches a session an application drives (POST
// /sessions): no microphone, nothing sent, and Stop leaves the session running.
const watching = (() => {
  const params = new URLSearchParams(location.search);
  const session = params.get('session');
  return session ? { session_id: session, token: params.get('token') || '' } : null;
})();

// A viewer's page: it says what it shows, and has none of the microphone page's controls
// (the avatar, its size and its knobs are the application's to choose; a viewer may not
// change them). The sound is on: it is the application's speech, not the viewer's own
// voice coming back, so nothing echoes, and Start is the gesture that lets it play.
function becomeViewer() {
  document.title = 'Watching an avatar · Sonic media server';
  ui.tagline.textContent = 'Watching an avatar that an application drives: press Start to ' +
    'see it and hear it speak.';
  ui.muteLabel.textContent = 'Mute the avatar';
  ui.muteHint.textContent = 'Its speech plays with sound once you press Start. Stop leaves ' +
    'the session running for the application and its other viewers.';
  ui.chooser.hidden = true;
  ui.knobs.hidden = true;
  ui.say.hidden = false;
  // The session's own portrait while it is not playing, where the server lets a viewer see
  // which it is (with API keys on it does not: the picture stays empty).
  api('GET', `sessions/${encodeURIComponent(watching.session_id)}`)
    .then(({ avatar }) => showPoster(`avatars/${encodeURIComponent(avatar)}/image`))
    .catch(() => {});
}

async function start() {
  clearError();
  if (!watching && !navigator.mediaDevices?.getUserMedia) {
    showError('The microphone is only available on a secure page: open it over HTTPS ' +
      'or on localhost.');
    return;
  }
  setRunning(true);
  setState('starting', watching ? 'Joining the session…' : 'Asking for the microphone…');
  const peer = new RTCPeerConnection({ iceServers: [] });
  pc = peer;
  try {
    if (watching) {
      peer.addTransceiver('audio', { direction: 'recvonly' });
      openEvents(peer);
    } else {
      const stream = await navigator.mediaDevices.getUserMedia({
        audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true },
        video: false,
      });
      if (pc !== peer) { // stopped while the permission prompt was open
        stream.getTracks().forEach((track) => track.stop());
        return;
      }
      mic = stream;
      for (const track of mic.getAudioTracks()) peer.addTrack(track, mic); // sendrecv audio
    }
    const remote = new MediaStream();
    peer.addEventListener('track', (event) => remote.addTrack(event.track));
    peer.addEventListener('connectionstatechange', () => onConnectionState(peer));
    peer.addTransceiver('video', { direction: 'recvonly' });

    setState('starting', 'Gathering network candidates…');
    await peer.setLocalDescription(await peer.createOffer());
    await iceGatheringComplete(peer);

    setState('starting', 'Connecting…');
    const answer = await offerOnceReady(peer, {
      sdp: peer.localDescription.sdp,
      type: peer.localDescription.type,
      ...(watching ?? { avatar: avatarId, options: { ...knobs(), size: Number(ui.size.value) } }),
    });
    if (pc !== peer) { // stopped while waiting for the answer
      if (!watching) await api('DELETE', `sessions/${answer.session_id}`).catch(() => {});
      return;
    }
    sessionId = answer.session_id;
    await peer.setRemoteDescription({ type: answer.type, sdp: answer.sdp });
    ui.video.muted = ui.mute.checked;
    ui.video.srcObject = remote;
    ui.video.play().catch((error) => playMuted(peer, error));
    previous = null;
    statsTimer = setInterval(() => { statsPoll = refreshStats().catch(showError); }, 1000);
  } catch (error) {
    if (pc !== peer) return; // stopped meanwhile: closing the peer aborts the steps above
    showError(`Could not ${watching ? 'watch' : 'start'}: ${error.message}`);
    await stop({ keepError: true });
  }
}

// A browser that will not play sound without a gesture it still counts (Start was pressed,
// but some count only the click's own moment) plays the picture muted and says so.
function playMuted(peer, error) {
  if (pc !== peer) return; // stopped meanwhile
  if (error.name !== 'NotAllowedError' || ui.video.muted) {
    showError(`The video could not play: ${error.message}`);
    return;
  }
  ui.mute.checked = true;
  ui.video.muted = true;
  ui.video.play().then(
    () => showError('The browser would not play sound yet: untick “Mute” to hear it.'),
    (again) => showError(`The video could not play: ${again.message}`));
}

// A server just started measures what a session costs before it takes any: its offers
// answer 503 "calibrating" for a few seconds. Ask again when its Retry-After says, for as
// long as this peer is the page's and at most START_WAIT_MS; any other refusal is shown.
const START_WAIT_MS = 60000;

async function offerOnceReady(peer, body) {
  const giveUpAt = performance.now() + START_WAIT_MS;
  while (true) {
    try {
      return await api('POST', 'offer', body);
    } catch (error) {
      if (error.code !== 'calibrating' || pc !== peer || performance.now() > giveUpAt) throw error;
      const seconds = error.retryAfter ?? 5;
      setState('starting', `The server is starting: trying again in ${seconds} s…`);
      await new Promise((resolve) => setTimeout(resolve, seconds * 1000));
      if (pc !== peer) throw error;
      setState('starting', 'Connecting…');
    }
  }
}

function onConnectionState(peer) {
  if (peer !== pc) return;
  const s = peer.connectionState;
  setState(s, s === 'connected' ? (watching ? 'Watching the session' : 'Connected: speak!')
    : undefined);
  if (s === 'failed') {
    showError('The connection failed (no network path to the server?).');
    stop({ keepError: true });
  }
}

async function stop({ keepError = false, hangUp = !watching } = {}) {
  if (!keepError) clearError();
  clearInterval(statsTimer);
  statsTimer = null;
  const id = sessionId;
  const peer = pc;
  sessionId = null;
  pc = null;
  mic?.getTracks().forEach((track) => track.stop());
  mic = null;
  channel = null;
  ui.saySend.disabled = true;
  ui.video.srcObject = null;
  ui.video.poster = poster;
  for (const value of ui.stats.querySelectorAll('dd')) value.textContent = '–';
  setRunning(false);
  setState('stopped', 'Stopped');
  // Hang up before closing the peer: a closed peer ends the session on the server by itself,
  // and the DELETE would then race it. Let a stats poll in flight finish first, too.
  if (id && hangUp) {
    await statsPoll;
    try {
      await api('DELETE', `sessions/${id}`);
    } catch (error) {
      if (error.status !== 404) showError(`Could not end the session: ${error.message}`);
    }
  }
  peer?.close();
}

// ---- events and messages (viewer mode) ----------------------------------------------

// The session's events arrive on a data channel labelled "events"; text typed into the box
// goes back on it as {"type": "message", "text"}, and the application driving the session
// (an agent, say) hears it and may speak in answer.
function openEvents(peer) {
  const events = peer.createDataChannel('events');
  channel = events;
  events.addEventListener('open', () => { if (channel === events) ui.saySend.disabled = false; });
  events.addEventListener('close', () => { if (channel === events) ui.saySend.disabled = true; });
  events.addEventListener('message', (message) => {
    if (channel !== events) return;
    try {
      onEvent(JSON.parse(message.data));
    } catch (error) {
      console.error('an event that is not JSON', error);
    }
  });
}

function describe(event) {
  switch (event.type) {
    case 'viewer_message': return `Asked: “${event.text}”`;
    case 'utterance_started': return `Speaking (${event.utterance_id})`;
    case 'utterance_ended': return `Finished speaking (${event.utterance_id})`;
    case 'interrupted': return event.interrupted.length
      ? `Cut off after ${event.interrupted.map((u) => `${u.heard_s} s`).join(', ')}`
      : 'Interrupted (nothing was playing)';
    default: return null;
  }
}

function onEvent(event) {
  if (event.type === 'error') {
    showError(event.message);
    return;
  }
  const text = describe(event);
  if (!text) return;
  const item = Object.assign(document.createElement('li'), { textContent: text });
  item.dataset.type = event.type;
  ui.events.prepend(item);
  while (ui.events.children.length > 8) ui.events.lastElementChild.remove();
  ui.events.hidden = false;
}

function sendMessage(submit) {
  submit.preventDefault();
  const text = ui.sayText.value.trim();
  if (!text || channel?.readyState !== 'open') return;
  clearError();
  channel.send(JSON.stringify({ type: 'message', text }));
  ui.sayText.value = '';
}

// ---- knobs --------------------------------------------------------------------------

let patchTimer = null;

function onKnob(input) {
  $(`${input.id}-value`).textContent = Number(input.value).toFixed(2);
  clearTimeout(patchTimer);
  patchTimer = setTimeout(async () => {
    if (!sessionId) return;
    try {
      await api('PATCH', `sessions/${sessionId}`, knobs());
    } catch (error) {
      showError(`Could not update the session: ${error.message}`);
    }
  }, 100);
}

// ---- stats --------------------------------------------------------------------------

function showStat(name, value) {
  ui.stats.querySelector(`[data-stat="${name}"]`).textContent = value;
}

function ms(seconds) {
  if (!Number.isFinite(seconds)) return '–';
  const value = 1000 * seconds;
  return `${value.toFixed(Math.abs(value) < 10 ? 1 : 0)} ms`;
}

// Mean jitter-buffer delay over the last interval (cumulative mean before the first one).
function jitterDelay(now, before) {
  if (!now?.jitterBufferEmittedCount) return NaN;
  const count = now.jitterBufferEmittedCount - (before?.jitterBufferEmittedCount ?? 0);
  const delay = now.jitterBufferDelay - (before?.jitterBufferDelay ?? 0);
  return count > 0 ? delay / count : now.jitterBufferDelay / now.jitterBufferEmittedCount;
}

async function refreshStats() {
  const peer = pc;
  if (!peer) return;
  let video;
  let audio;
  let pair;
  let report;
  try {
    report = await peer.getStats();
  } catch {
    return; // closed meanwhile
  }
  if (peer !== pc) return; // stopped meanwhile
  report.forEach((s) => {
    if (s.type === 'inbound-rtp' && s.kind === 'video') video = s;
    else if (s.type === 'inbound-rtp' && s.kind === 'audio') audio = s;
    else if (s.type === 'transport' && s.selectedCandidatePairId) {
      pair = report.get(s.selectedCandidatePairId);
    }
  });
  report.forEach((s) => {
    if (!pair && s.type === 'candidate-pair' && s.nominated && s.state === 'succeeded') pair = s;
  });
  const now = { t: performance.now(), video, audio };
  const before = previous;
  previous = now;

  framesDecoded = video?.framesDecoded ?? 0;
  let fps = video?.framesPerSecond;
  if (fps === undefined && before?.video) {
    fps = (framesDecoded - before.video.framesDecoded) / ((now.t - before.t) / 1000);
  }
  const videoDelay = jitterDelay(video, before?.video);
  const audioDelay = jitterDelay(audio, before?.audio);
  showStat('fps', Number.isFinite(fps) ? fps.toFixed(1) : '–');
  showStat('framesDecoded', String(framesDecoded));
  showStat('rtt', ms(pair?.currentRoundTripTime));
  showStat('videoJitter', ms(videoDelay));
  showStat('audioJitter', ms(audioDelay));
  showStat('avOffset', ms(videoDelay - audioDelay));
  ui.stats.dataset.framesDecoded = String(framesDecoded);

  if (!sessionId) return;
  try {
    const { stats } = await api('GET', `sessions/${sessionId}`);
    if (peer !== pc) return;
    showStat('pipelineP95', stats.pipeline_delay_ms?.p95 != null
      ? `${stats.pipeline_delay_ms.p95.toFixed(0)} ms` : '–');
    showStat('serverFps', stats.fps != null ? stats.fps.toFixed(1) : '–');
  } catch (error) {
    if (error.status === 404 && peer === pc) {
      showError('The server ended the session.');
      stop({ keepError: true, hangUp: false });
    }
  }
}

// ---- wiring -------------------------------------------------------------------------

ui.start.addEventListener('click', start);
ui.stop.addEventListener('click', () => stop());
ui.upload.addEventListener('change', uploadAvatar);
ui.mute.addEventListener('change', () => { ui.video.muted = ui.mute.checked; });
ui.say.addEventListener('submit', sendMessage);
// Set, not left to the markup: a reload may restore a checkbox as it was left, and the
// microphone page must start muted (its audio is your own voice, echo-prone).
ui.mute.checked = !watching;
if (watching) becomeViewer();
// Leaving the page ends the session at once rather than after the server's peer timeout
// (a viewer's leaving ends only its own connection).
window.addEventListener('pagehide', () => {
  if (sessionId && !watching) {
    fetch(`sessions/${sessionId}`, { method: 'DELETE', keepalive: true });
  }
});

window.sonic = {
  get state() { return state; },
  get sessionId() { return sessionId; },
  get avatarId() { return avatarId; },
  // Fresh from the receiver's stats, not the last panel refresh.
  async framesDecoded() {
    if (!pc) return framesDecoded;
    let frames = framesDecoded;
    (await pc.getStats()).forEach((s) => {
      if (s.type === 'inbound-rtp' && s.kind === 'video') frames = s.framesDecoded ?? frames;
    });
    return frames;
  },
  // The returned speech as the receiver has it: samples played out, of them concealed
  // (made up for audio that did not come), packets, and its energy.
  async audioReceived() {
    const audio = { samples: 0, concealed: 0, packets: 0, energy: 0 };
    if (!pc) return audio;
    (await pc.getStats()).forEach((s) => {
      if (s.type === 'inbound-rtp' && s.kind === 'audio') {
        audio.samples = s.totalSamplesReceived ?? 0;
        audio.concealed = s.concealedSamples ?? 0;
        audio.packets = s.packetsReceived ?? 0;
        audio.energy = s.totalAudioEnergy ?? 0; // sums the level² over time: 0 in silence
      }
    });
    return audio;
  },
  // Packets of the microphone's speech sent so far (the answer asks for 40 ms a packet).
  async audioPacketsSent() {
    let packets = 0;
    if (!pc) return packets;
    (await pc.getStats()).forEach((s) => {
      if (s.type === 'outbound-rtp' && s.kind === 'audio') packets = s.packetsSent ?? 0;
    });
    return packets;
  },
};

if (!watching) {
  loadAvatars().catch((error) => {
    ui.avatars.replaceChildren();
    showError(`Could not load the avatars: ${error.message}`);
  });
  loadControls().catch((error) => showError(`Could not load the controls: ${error.message}`));
}
