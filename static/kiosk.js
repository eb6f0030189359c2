// The kiosk: full screen, one named session as a viewer, no clicks needed. It finds the
// session by name (GET names/{name}?token=), watches it, and starts again by itself when
// the picture stops: a network drop, the session made anew, the server restarted. A
// picture that stopped moving is never left on screen without a notice over it.
'use strict';

const params = new URLSearchParams(location.search);
const NAME = params.get('name');
const TOKEN = params.get('token') || '';
const STALL_MS = 1000;      // no new frame this long: say so over the picture
const RECONNECT_MS = 4000;  // ... this long: start again
const video = document.getElementById('video');
const notice = document.getElementById('notice');
const sound = document.getElementById('sound');

// What the kiosk is doing, for whoever watches it (and the tests).
window.kiosk = {state: 'starting', frames: 0, connects: 0, muted: false, notice: ''};
let lastFrameAt = 0;

function say(text) {
  notice.textContent = text;
  notice.hidden = !text;
  window.kiosk.notice = text;
}

function onFrame() {
  window.kiosk.frames += 1;
  lastFrameAt = performance.now();
  video.requestVideoFrameCallback(onFrame);
}
video.requestVideoFrameCallback(onFrame);

// Sound needs a gesture where the browser's autoplay policy says so: muted until then.
async function play() {
  video.muted = false;
  try {
    await video.play();
  } catch (error) {
    video.muted = true;
    await video.play().catch(() => {});
  }
  window.kiosk.muted = video.muted;
  sound.hidden = !video.muted;
}
function unmute() {
  if (!video.muted) return;
  video.muted = false;
  window.kiosk.muted = false;
  sound.hidden = true;
  video.play().catch(() => {});
}
addEventListener('pointerdown', unmute);
addEventListener('keydown', unmute);

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function findSession() {
  const response = await fetch(`names/${encodeURIComponent(NAME)}?token=${encodeURIComponent(TOKEN)}`);
  if (response.status === 200) return (await response.json()).session_id;
  if (response.status === 403) throw new Error('the kiosk\'s token is not this session\'s');
  return null;
}

async function watch(sessionId) {
  const pc = new RTCPeerConnection();
  pc.addTransceiver('video', {direction: 'recvonly'});
  pc.addTransceiver('audio', {direction: 'recvonly'});
  const stream = new MediaStream();
  pc.ontrack = (event) => stream.addTrack(event.track);
  await pc.setLocalDescription(await pc.createOffer());
  await new Promise((resolve) => {
    if (pc.iceGatheringState === 'complete') return resolve();
    pc.onicegatheringstatechange = () => pc.iceGatheringState === 'complete' && resolve();
    setTimeout(resolve, 3000);
  });
  const response = await fetch('offer', {
    method: 'POST', headers: {'Content-Type': 'application/json'},
    body: JSON.stringify({session_id: sessionId, token: TOKEN,
                          sdp: pc.localDescription.sdp, type: 'offer'})});
  if (response.status !== 200) {
    pc.close();
    throw new Error(`the server answered ${response.status}`);
  }
  await pc.setRemoteDescription(await response.json());
  video.srcObject = stream;
  await play();
  return pc;
}

// One connection's life: returns when the picture has stopped for RECONNECT_MS or the
// connection failed.
async function hold(pc) {
  const since = performance.now();
  lastFrameAt = 0;
  while (true) {
    await sleep(250);
    const now = performance.now();
    const quiet = now - (lastFrameAt || since);
    const failed = ['failed', 'closed'].includes(pc.connectionState);
    if (failed || quiet > RECONNECT_MS) return;
    if (lastFrameAt && quiet <= STALL_MS) {
      window.kiosk.state = 'playing';
      say('');
    } else if (lastFrameAt) {
      window.kiosk.state = 'stalled';
      say('The picture has paused — reconnecting…');
    }
  }
}

async function main() {
  if (!NAME) {
    say('This kiosk needs ?name=SESSION_NAME&token=TOKEN in its address.');
    return;
  }
  let wait = 500;
  while (true) {
    let pc = null;
    try {
      window.kiosk.state = 'connecting';
      const sessionId = await findSession();
      if (sessionId === null) {
        window.kiosk.state = 'waiting';
        say(`Waiting for ${NAME}…`);
      } else {
        say(window.kiosk.connects ? 'Reconnecting…' : 'Connecting…');
        pc = await watch(sessionId);
        window.kiosk.connects += 1;
        wait = 500;
        await hold(pc);
      }
    } catch (error) {
      window.kiosk.state = 'offline';
      say(`Reconnecting… (${error.message})`);
    } finally {
      if (pc) pc.close();
    }
    video.srcObject = null;  // no frozen frame behind the notice
    if (window.kiosk.state === 'playing' || window.kiosk.state === 'stalled') {
      window.kiosk.state = 'reconnecting';
      say('The picture has paused — reconnecting…');
    }
    await sleep(wait);
    wait = Math.min(wait * 2, 5000);
  }
}

main();
